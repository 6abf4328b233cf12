"""FP8 (E4M3) KV cache, decode attention: the reads (and the new token's write) against the
reference's attention in fp32 over the same codes and scales, in the interpreter on the CPU and
compiled on a GPU, every form (V_DEQUANT, F16_DOT, block ids in registers, splits, windows)."""

import pytest
import torch
from kernel_testing import force_ids_in_registers, DEVICE, assert_close, gpu, new_token_rows, pairwise, poisoned, requires_cuda, run_ptx_check

from tandem.kernels import decode_attention as decode_module
from tandem.kernels import reference
from tandem.kernels.decode_attention import _launch_decode_attention, decode_attention, decode_attention_new_token

from fp8_kv_testing import ATTN_SCALE, DTYPES, HEAD_CONFIGS, codes, fp8_paged_kv, ordinal, rotary_table


def _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, window):
    with q.device:
        return reference.decode_attention(q.float(), k_cache, v_cache, tables, lens, q.shape[-1]**-0.5, window,
                                          k_scale, v_scale)


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 20],
    "num_splits": [1, 3],
})
def test_decode_attention_reads_codes_times_scales(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim,
                                                   block_size, window, num_splits):
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    seq_lens = [1, 70, 33, 0, 130]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, k_scale, v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, window)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_attention_with_block_ids_in_registers(monkeypatch, num_splits):
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    force_ids_in_registers(monkeypatch, True)
    seq_lens = [64, 65, 1, 129, 31, 150]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, 16, 2, 64)
    q = torch.randn(len(seq_lens), 8, 64, device=DEVICE).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 64**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@pytest.mark.parametrize("ids_in_registers", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_attention_with_the_register_prefetch_form(monkeypatch, num_splits, ids_in_registers):
    """REG_PREFETCH over an FP8 cache, with the rule's forms of it (V widened by its scale, products
    in fp16): the reference's answer."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    force_ids_in_registers(monkeypatch, ids_in_registers)
    seq_lens = [64, 65, 1, 129, 31, 0, 150]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, 16, 2, 64)
    q = torch.randn(len(seq_lens), 8, 64, device=DEVICE).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, torch.bfloat16)
    _launch_decode_attention(q, k_cache, v_cache, tables, lens, out, 64**-0.5, None, None, k_scale=k_scale,
                             v_scale=v_scale, reg_prefetch=True)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_with_v_widened_by_its_scale(dtype, num_splits):
    """V_DEQUANT (a tuning form): V's codes times its scale in q's dtype inside the tile, the output
    left unscaled; the same answer as the codes-then-scale form, within q's dtype's rounding."""
    seq_lens = [1, 70, 33, 0, 130]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, 16, 2, 64)
    q = torch.randn(len(seq_lens), 8, 64, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, dtype)
    _launch_decode_attention(q, k_cache, v_cache, tables, lens, out, 64**-0.5, None, None,
                             (32, 4, 2, num_splits, True, True), k_scale=k_scale, v_scale=v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pairwise({
    "dtype": [torch.float16, torch.bfloat16],
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "num_splits": [1, 3],
    "ids_in_registers": [False, True],
})
def test_decode_attention_with_fp16_products(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                                             num_splits, ids_in_registers):
    """F16_DOT (a tuning form): q with the score scale in it, K and V widened to fp16, V times its
    scale's mantissa in fp16; the reference's answer within q's dtype's rounding."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    monkeypatch.setattr(decode_module, "F16_DOT", True)
    force_ids_in_registers(monkeypatch, ids_in_registers)
    seq_lens = [1, 70, 33, 0, 130]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pairwise({
    "dtype": [torch.float16, torch.bfloat16],
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "num_splits": [1, 3],
    "ids_in_registers": [False, True],
    "reg_prefetch": [False, True],
    "window": [None, 20],
})
def test_decode_attention_with_fp8_scores(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                                          num_splits, ids_in_registers, reg_prefetch, window):
    """FP8_QK (a tuning form): the scores from q's E4M3 codes (a scale per head) times K's codes,
    P.V as F16_DOT's; the reference's attention with q quantized the same way (reference.fp8_query),
    within q's dtype's rounding; and against q unquantized, within FP8's."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    monkeypatch.setattr(decode_module, "FP8_QK", True)
    force_ids_in_registers(monkeypatch, ids_in_registers)
    seq_lens = [1, 70, 33, 0, 130]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    q[1, 0] = 0.0  # a head of zeros: scale 1, uniform attention
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = poisoned(q.shape, dtype)
    plan = decode_module.launch_plan(len(seq_lens), tables.shape[1], dtype, k_cache, window)
    assert plan.fp8_qk and plan.f16_dot
    _launch_decode_attention(q, k_cache, v_cache, tables, lens, out, head_dim**-0.5, window, None,
                             k_scale=k_scale, v_scale=v_scale, reg_prefetch=reg_prefetch)
    expected = _expected_decode(reference.fp8_query(q), k_cache, v_cache, tables, lens, k_scale, v_scale, window)
    assert_close(out, expected.to(dtype), dtype, ATTN_SCALE[dtype])
    unquantized = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, window)
    assert (out.float() - unquantized.float()).abs().max() < 0.1


def test_fp8_scores_keep_a_nan_in_q(monkeypatch):
    monkeypatch.setattr(decode_module, "FP8_QK", True)
    seq_lens = [40, 17]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, 16, 2, 64)
    q = torch.randn(2, 4, 64, device=DEVICE).to(torch.bfloat16)
    q[0, 1, 5] = float("nan")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 64**-0.5, None, k_scale, v_scale)
    assert out[0, 1].isnan().all()
    expected = _expected_decode(reference.fp8_query(q), k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[0, 1] = False
    assert_close(out[keep], expected[keep].to(torch.bfloat16), torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@pytest.mark.parametrize("q_scale", [3e4, 1e-3])
def test_fp16_products_take_a_q_beyond_fp16s_range(monkeypatch, q_scale):
    """A bf16 q of 3e4 * N(0, 1) (past fp16's 65504 in places) or of 1e-3 * N(0, 1) (fp16's
    subnormals after the scale): the score scale goes into q before fp16, so the answer is the
    reference's (one-hot scores at 3e4, near-uniform at 1e-3)."""
    monkeypatch.setattr(decode_module, "F16_DOT", True)
    seq_lens = [70, 33]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, 16, 2, 64)
    q = (torch.randn(len(seq_lens), 4, 64, device=DEVICE) * q_scale).to(torch.bfloat16)
    assert q.float().abs().max() > 65504 or q_scale < 1
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 64**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert out.isfinite().all()
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


def _new_token_inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, padded_row):
    """The caches hold every sequence's earlier tokens as codes; the new token's slot is NaN until written."""
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q, k, v, positions, slots, lens = new_token_rows(seq_lens, tables, k_cache, v_cache, block_size, num_q_heads,
                                                     head_dim, dtype, padded_row)
    rotary = rotary_table(max(512, max(seq_lens)), head_dim)  # a row for every position written
    return q, k, v, positions, rotary, k_cache, v_cache, slots, tables, lens, k_scale, v_scale


def _check_new_token(inputs, dtype, window):
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens, k_scale, v_scale = inputs
    num_kv_heads, head_dim = k.shape[1:]
    before = (codes(k_cache).clone(), codes(v_cache).clone())
    out = decode_attention_new_token(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens,
                                     head_dim**-0.5, window, k_scale, v_scale)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = reference.rotary_kv_write(q, k, v, positions, cos_sin, ref_k, ref_v, slots, k_scale, v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _expected_decode(q_rot, ref_k, ref_v, tables, lens, k_scale, v_scale, window)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])
    flat = lambda c: codes(c).view(-1, num_kv_heads, head_dim)  # noqa: E731
    written = slots[slots >= 0]
    # the codes of the rotated k (fp32 math, rounded to q's dtype): the reference's, but where the
    # GPU compiler (or the interpreter's bf16 rounding) rounded that rotation an ulp apart
    k_apart = (ordinal(flat(k_cache)[written]) - ordinal(flat(ref_k)[written])).abs()
    assert k_apart.max() <= 1 and (k_apart == 0).float().mean() > 0.95
    assert torch.equal(flat(v_cache)[written], flat(ref_v)[written])
    others = torch.ones(flat(k_cache).shape[0], dtype=torch.bool, device=DEVICE)
    others[written] = False
    for cache, old in zip((k_cache, v_cache), before):  # nothing else was written
        assert torch.equal(flat(cache)[others], old.view(-1, num_kv_heads, head_dim)[others])


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "num_splits": [1, 3],
    "prefetch": [False, True],
    "f16_dot": [False, True],
})
def test_decode_new_token_writes_and_attends_codes(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim,
                                                   block_size, num_splits, prefetch, f16_dot):
    """The fused rotary + KV write + attention: the new token's codes in its slot, and attended
    as those codes (read back, or with PREFETCH put into the last tile from registers), with the
    products in q's dtype or (F16_DOT, a 16-bit q) in fp16."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    monkeypatch.setattr(decode_module, "F16_DOT", f16_dot)
    monkeypatch.setattr(decode_module, "PREFETCH", prefetch)
    monkeypatch.setattr(decode_module, "PREFETCH_MAX_BATCH", 1 << 20)
    inputs = _new_token_inputs([1, 70, 33, 130, 2], num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                               padded_row=4)
    _check_new_token(inputs, dtype, None)


def test_decode_new_token_with_a_window(monkeypatch):
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: 2)
    inputs = _new_token_inputs([1, 70, 33, 130, 2], 4, 2, 64, 8, torch.bfloat16, padded_row=4)
    _check_new_token(inputs, torch.bfloat16, 20)


# ---- real shapes on a GPU (tests/gpu and `bash scripts/gpu.sh tests` run these) -------------------

@gpu
@requires_cuda
@pytest.mark.parametrize("batch, context, ids_in_registers", [(1, 256, None), (64, 256, None), (128, 416, None),
                                                             (8, 4096, None), (64, 256, True), (8, 1000, False)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("f16_dot", [None, False, True])
def test_gpu_decode_attention_real_shapes(batch, context, num_q_heads, num_kv_heads, ids_in_registers, f16_dot,
                                          monkeypatch):
    """The shape rule's tiles (None: decode_config's FP8 rule, 128- or 64-token tiles, the block
    ids in registers on the wide grids) and each form forced, the products as the rule says
    (None: fp16) or forced."""
    force_ids_in_registers(monkeypatch, ids_in_registers)
    monkeypatch.setattr(decode_module, "F16_DOT", f16_dot)
    lens = [context - 7 * i % 50 for i in range(batch)]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(lens, 16, num_kv_heads, 128, "cuda")
    q = torch.randn(batch, num_q_heads, 128, device="cuda", dtype=torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = decode_attention(q, k_cache, v_cache, tables, lens_t, 128**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens_t, k_scale, v_scale, None)
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@gpu
@requires_cuda
@pytest.mark.parametrize("batch, context", [(64, 256), (256, 192), (8, 4096)])
@pytest.mark.parametrize("reg_prefetch", [False, True])
def test_gpu_decode_attention_fp8_scores_real_shapes(batch, context, reg_prefetch, monkeypatch):
    """FP8_QK compiled (sm90: the scores by wgmma over E4M3) at the rule's tiles, llama3-8b's heads
    (32 query heads over 8 KV heads): the reference's attention with q quantized as the form does."""
    num_q_heads, num_kv_heads = 32, 8
    monkeypatch.setattr(decode_module, "FP8_QK", True)
    lens = [context - 7 * i % 50 for i in range(batch)]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(lens, 16, num_kv_heads, 128, "cuda")
    q = torch.randn(batch, num_q_heads, 128, device="cuda", dtype=torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    _launch_decode_attention(q, k_cache, v_cache, tables, lens_t, out, 128**-0.5, None, None, k_scale=k_scale,
                             v_scale=v_scale, reg_prefetch=reg_prefetch)
    expected = _expected_decode(reference.fp8_query(q), k_cache, v_cache, tables, lens_t, k_scale, v_scale, None)
    assert_close(out, expected.to(torch.bfloat16), torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@gpu
@requires_cuda
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("batch, context", [(1, 256), (8, 1000), (64, 256)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("f16_dot", [False, True])
def test_gpu_decode_new_token_real_shapes(batch, context, num_q_heads, num_kv_heads, prefetch, f16_dot, monkeypatch):
    monkeypatch.setattr(decode_module, "PREFETCH", prefetch)
    monkeypatch.setattr(decode_module, "F16_DOT", f16_dot)
    monkeypatch.setattr(decode_module, "PREFETCH_MAX_BATCH", 1 << 20)
    lens = [context - 7 * i % 50 for i in range(batch)]
    inputs = _new_token_inputs(lens, num_q_heads, num_kv_heads, 128, 16, torch.bfloat16, padded_row=None)
    _check_new_token(inputs, torch.bfloat16, None)


def test_v_dequant_reads_v_by_ldmatrix_in_the_sm90_ptx():
    """fp8_attention_ptx_check.py compiles the FP8 cache forms for sm90 (outside the interpreter):
    V_DEQUANT and F16_DOT read V by transposing ldmatrix, F16_DOT widens with one conversion per
    two codes and multiplies on fp16 tensor cores."""
    assert "ok: the FP8 cache's V operand reads" in run_ptx_check("fp8_attention_ptx_check.py")


def test_the_switch_turns_fp8_scores_on_and_off_for_the_served_step(monkeypatch):
    """TANDEM_FP8_QK_SCORES (kernels.switches) replaces the rule (decode_config.FP8_QK_SCORES) in the
    launch plan, so a served run measures the form without a code change; the module's FP8_QK forces
    either way over both; a 16-bit cache never takes it."""
    from tandem.kernels import switches

    seq_lens = [40, 17]
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, 16, 2, 64)
    try:
        for value, expected in (("1", True), ("0", False)):
            monkeypatch.setenv("TANDEM_FP8_QK_SCORES", value)
            switches.reload()
            assert decode_module.launch_plan(2, tables.shape[1], torch.bfloat16, k_cache).fp8_qk is expected
            monkeypatch.setattr(decode_module, "FP8_QK", not expected)
            assert decode_module.launch_plan(2, tables.shape[1], torch.bfloat16, k_cache).fp8_qk is (not expected)
            monkeypatch.setattr(decode_module, "FP8_QK", None)
        monkeypatch.setenv("TANDEM_FP8_QK_SCORES", "1")
        switches.reload()
        assert not decode_module.launch_plan(2, tables.shape[1], torch.bfloat16, k_cache.to(torch.bfloat16)).fp8_qk
        monkeypatch.setenv("TANDEM_FP8_QK_SCORES", "2")
        with pytest.raises(ValueError, match="TANDEM_FP8_QK_SCORES"):
            switches.reload()
            switches.current()
    finally:
        monkeypatch.delenv("TANDEM_FP8_QK_SCORES", raising=False)
        switches.reload()
