"""FP8 (E4M3) KV cache: every kernel that writes or reads the cache against its torch reference
(reference.quantize_kv_fp8 / dequantize_kv_fp8), in the interpreter on the CPU and compiled on a GPU.

The writes must store the reference's codes bit for bit (given the same rotated k); the reads
are compared with the reference's attention in fp32 over the same codes and scales. The scales
differ per KV head and include one that is not a power of two (as a checkpoint's may be)."""


import pytest
import torch
import triton
import triton.language as tl
from kernel_testing import DEVICE, assert_close, gpu, make_paged_kv, pairwise, poisoned, requires_cuda, run_ptx_check

from tandem.kernels import decode_attention as decode_module
from tandem.kernels import reference
from tandem.kernels.block_copy import gather_blocks, scatter_blocks
from tandem.kernels.decode_attention import _launch_decode_attention, decode_attention, decode_attention_new_token
from tandem.kernels.fp8_kv import quantize_kv_fp8, soft_round
from tandem.kernels.prefill_attention import prefill_attention
from tandem.kernels.rotary import rotary_kv_write

F8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_SCALE = {torch.float32: 1.0, torch.float16: 2.5, torch.bfloat16: 1.5}
HEAD_CONFIGS = [(2, 2, 64, 16), (4, 1, 128, 16), (8, 2, 32, 4)]  # (q heads, kv heads, head_dim, block): GQA 1, 4


def _scales(num_kv_heads, device=DEVICE):
    """(k_scale, v_scale) [H]: powers of two as calibration makes them, and 0.0123 (a checkpoint's)."""
    k = torch.tensor([2.0**-5, 0.0123, 2.0**-3, 2.0**-6])[torch.arange(num_kv_heads) % 4]
    v = torch.tensor([0.0123, 2.0**-6, 2.0**-4, 2.0**-2])[torch.arange(num_kv_heads) % 4]
    return k.to(device), v.to(device)


def _fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, device=DEVICE):
    """make_paged_kv's keys and values as codes (its NaN slots stay NaN codes) and their scales."""
    k_cache, v_cache, tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, device)
    k_scale, v_scale = _scales(num_kv_heads, device)
    return reference.quantize_kv_fp8(k_cache, k_scale), reference.quantize_kv_fp8(v_cache, v_scale), tables, k_scale, v_scale


def _codes(t):
    return t.view(torch.uint8)


def _ordinal(t):
    """E4M3 codes as integers in the order of their values (+0 and -0 both 0): neighbours differ by 1."""
    c = _codes(t).int()
    return torch.where(c >= 128, 128 - c, c)


def _cos_sin(max_position, head_dim, device=DEVICE):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


@triton.jit
def _quantize_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, quantize_kv_fp8(x, tl.load(scale_ptr), SOFT_ROUND), mask=offs < n)


@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 0.0123])
def test_quantize_stores_the_references_codes(scale):
    """Every E4M3 value and every midpoint between two (ties to even), subnormals, values past
    448 (saturated), -0.0 and random values: the kernel's codes are torch's."""
    values = torch.arange(256, dtype=torch.uint8).view(F8).float()
    values = values[~values.isnan()].sort().values
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([0.0, -0.0, 1e4, -1e4, 449.0, 464.0]),
                   torch.randn(4000) * 60, torch.randn(1000) * 1e-3]) * scale
    x = x.to(DEVICE)
    s = torch.tensor([scale], device=DEVICE)
    out = torch.empty(x.shape, dtype=F8, device=DEVICE)
    _quantize_kernel[(triton.cdiv(x.numel(), 1024),)](x, s, out, x.numel(), BLOCK=1024, SOFT_ROUND=soft_round())
    assert torch.equal(_codes(out), _codes(reference.quantize_kv_fp8(x[:, None], s)[:, 0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", [(4, 4, 64, 16), (8, 2, 128, 8),
                                                                              (6, 3, 16, 4)])
def test_rotary_writes_the_codes_of_the_rotated_k_and_v(dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    num_tokens, num_blocks = 11, 7
    q = torch.randn(num_tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) * 4).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k[0, 0, :4] = 1e4  # saturates
    positions = torch.randint(0, 500, (num_tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[2, 7]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = poisoned(shape, F8), poisoned(shape, F8)
    k_scale, v_scale = _scales(num_kv_heads)
    cos_sin = _cos_sin(512, head_dim)
    q_rot, k_rot = rotary_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slots, k_scale, v_scale)
    ref_q, ref_k = reference.rotary_kv_write(q, k, v, positions, cos_sin, poisoned(shape, F8), poisoned(shape, F8),
                                             slots, k_scale, v_scale)
    assert_close(q_rot, ref_q, dtype)
    assert_close(k_rot, ref_k, dtype)
    valid = slots >= 0
    flat = lambda c: c.view(-1, num_kv_heads, head_dim)  # noqa: E731
    assert torch.equal(_codes(flat(k_cache)[slots[valid]]), _codes(reference.quantize_kv_fp8(k_rot[valid], k_scale)))
    assert torch.equal(_codes(flat(v_cache)[slots[valid]]), _codes(reference.quantize_kv_fp8(v[valid], v_scale)))
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    unwritten[slots[valid]] = False
    assert flat(k_cache)[unwritten].float().isnan().all() and flat(v_cache)[unwritten].float().isnan().all()


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
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, k_scale, v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, window)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_attention_with_block_ids_in_registers(monkeypatch, num_splits):
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    monkeypatch.setattr(decode_module, "IDS_IN_REGISTERS", True)
    seq_lens = [64, 65, 1, 129, 31, 150]
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(seq_lens, 16, 2, 64)
    q = torch.randn(len(seq_lens), 8, 64, device=DEVICE).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 64**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_with_v_widened_by_its_scale(dtype, num_splits):
    """V_DEQUANT (a tuning form): V's codes times its scale in q's dtype inside the tile, the output
    left unscaled; the same answer as the codes-then-scale form, within q's dtype's rounding."""
    seq_lens = [1, 70, 33, 0, 130]
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(seq_lens, 16, 2, 64)
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
    monkeypatch.setattr(decode_module, "IDS_IN_REGISTERS", ids_in_registers)
    seq_lens = [1, 70, 33, 0, 130]
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pytest.mark.parametrize("q_scale", [3e4, 1e-3])
def test_fp16_products_take_a_q_beyond_fp16s_range(monkeypatch, q_scale):
    """A bf16 q of 3e4 * N(0, 1) (past fp16's 65504 in places) or of 1e-3 * N(0, 1) (fp16's
    subnormals after the scale): the score scale goes into q before fp16, so the answer is the
    reference's (one-hot scores at 3e4, near-uniform at 1e-3)."""
    monkeypatch.setattr(decode_module, "F16_DOT", True)
    seq_lens = [70, 33]
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(seq_lens, 16, 2, 64)
    q = (torch.randn(len(seq_lens), 4, 64, device=DEVICE) * q_scale).to(torch.bfloat16)
    assert q.float().abs().max() > 65504 or q_scale < 1
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, tables, lens, 64**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens, k_scale, v_scale, None)
    assert out.isfinite().all()
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


def _new_token_inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, padded_row):
    """The caches hold every sequence's earlier tokens as codes; the new token's slot is NaN until written."""
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    n = len(seq_lens)
    positions = torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64, device=DEVICE)
    slots = tables[torch.arange(n), positions // block_size].long() * block_size + positions % block_size
    for row, slot in enumerate(slots.tolist()):
        if row == padded_row:
            slots[row] = -1  # reads what is there, writes nothing
        else:
            k_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
            v_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
    q = torch.randn(n, num_q_heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(n, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    rotary = _cos_sin(max(512, max(seq_lens)), head_dim)  # a row for every position written
    return q, k, v, positions, rotary, k_cache, v_cache, slots, tables, lens, k_scale, v_scale


def _check_new_token(inputs, dtype, window):
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens, k_scale, v_scale = inputs
    num_kv_heads, head_dim = k.shape[1:]
    before = (_codes(k_cache).clone(), _codes(v_cache).clone())
    out = decode_attention_new_token(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens,
                                     head_dim**-0.5, window, k_scale, v_scale)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = reference.rotary_kv_write(q, k, v, positions, cos_sin, ref_k, ref_v, slots, k_scale, v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = _expected_decode(q_rot, ref_k, ref_v, tables, lens, k_scale, v_scale, window)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])
    flat = lambda c: _codes(c).view(-1, num_kv_heads, head_dim)  # noqa: E731
    written = slots[slots >= 0]
    # the codes of the rotated k (fp32 math, rounded to q's dtype): the reference's, but where the
    # GPU compiler (or the interpreter's bf16 rounding) rounded that rotation an ulp apart
    k_apart = (_ordinal(flat(k_cache)[written]) - _ordinal(flat(ref_k)[written])).abs()
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


def _prefill(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, window, chunk,
             device=DEVICE):
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, device)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens).cumsum(0)
    starts, lens = starts.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=device).to(dtype)
    chunk_kv = None
    if chunk:  # the chunk's own rows, unquantized; the cache's slots there are NaN codes
        chunk_kv = tuple(torch.randn(sum(q_lens), num_kv_heads, head_dim, device=device).to(dtype) for _ in "kv")
        for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
            for pos in range(seq_len - q_len, seq_len):
                block = tables[b, pos // block_size]
                k_cache[block, pos % block_size] = float("nan")
                v_cache[block, pos % block_size] = float("nan")
    scale = head_dim**-0.5
    out = prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, window, chunk_kv, k_scale, v_scale)
    chunk32 = None if chunk_kv is None else (chunk_kv[0].float(), chunk_kv[1].float())
    with torch.device(device):
        expected = reference.prefill_attention(q.float(), k_cache, v_cache, tables, starts, lens, scale, window,
                                               chunk32, k_scale, v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    return out, expected


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 5],
    "chunk": [False, True],
})
def test_prefill_attention_reads_codes_times_scales(dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                                                    window, chunk):
    """Chunked context (284 cached + 16 new), a fresh prompt, single tokens, an empty query."""
    out, expected = _prefill([300, 9, 40, 1, 12, 77], [16, 9, 1, 1, 0, 20], num_q_heads, num_kv_heads, head_dim,
                             block_size, dtype, window, chunk)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


def test_fp8_cache_without_scales_is_refused():
    k_cache, v_cache, tables, _, _ = _fp8_paged_kv([5], 4, 1, 16)
    q = torch.randn(1, 2, 16, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="k_scale and v_scale"):
        decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.25)


@pytest.mark.parametrize("block_size, heads, head_dim", [(4, 2, 16), (16, 1, 64)])
def test_block_copy_moves_fp8_blocks_bit_for_bit(block_size, heads, head_dim):
    pool = torch.randn(3, 2, 10, block_size, heads, head_dim, device=DEVICE).mul(100).to(F8)
    pool.view(torch.uint8)[0, 0, 3, 0, 0, :2] = 0x7F  # a NaN code travels as it is
    block_ids = torch.tensor([7, 0, 3, 9], device=DEVICE)
    staging = gather_blocks(pool, block_ids)
    assert staging.dtype == F8 and torch.equal(_codes(staging), _codes(reference.gather_blocks(pool, block_ids)))
    expected = pool.clone()
    new = torch.randn(staging.shape, device=DEVICE).to(F8)
    reference.scatter_blocks(expected, block_ids, new)
    scatter_blocks(pool, block_ids, new)
    assert torch.equal(_codes(pool), _codes(expected))


# ---- real shapes on a GPU (tests/gpu and `bash scripts/gpu.sh tests` run these) -------------------

@gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize("num_kv_heads", [8, 32])
def test_gpu_rotary_real_shapes(num_tokens, num_kv_heads):
    hq, d, bs, num_blocks = 32, 128, 16, 512
    q = torch.randn(num_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads, d, device="cuda", dtype=torch.bfloat16) * 8
    v = torch.randn(num_tokens, num_kv_heads, d, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    slots = torch.randperm(num_blocks * bs, device="cuda")[:num_tokens]
    slots[::7] = -1
    shape = (num_blocks, bs, num_kv_heads, d)
    k_cache, v_cache = poisoned(shape, F8, "cuda"), poisoned(shape, F8, "cuda")
    k_scale, v_scale = _scales(num_kv_heads, "cuda")
    _, k_rot = rotary_kv_write(q, k, v, positions, _cos_sin(8192, d, "cuda"), k_cache, v_cache, slots,
                               k_scale, v_scale)
    valid = slots >= 0
    flat = lambda c: c.view(-1, num_kv_heads, d)  # noqa: E731
    assert torch.equal(_codes(flat(k_cache)[slots[valid]]), _codes(reference.quantize_kv_fp8(k_rot[valid], k_scale)))
    assert torch.equal(_codes(flat(v_cache)[slots[valid]]), _codes(reference.quantize_kv_fp8(v[valid], v_scale)))


@gpu
@requires_cuda
@pytest.mark.parametrize("batch, context, ids_in_registers", [(1, 256, None), (64, 256, None), (128, 416, None),
                                                             (8, 4096, None), (64, 256, True), (8, 1000, False)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("f16_dot", [None, False, True])
def test_gpu_decode_attention_real_shapes(batch, context, num_q_heads, num_kv_heads, ids_in_registers, f16_dot,
                                          monkeypatch):
    """The shape rule's tiles (None: 64-token tiles, or 32 with the block ids in registers on
    the wide grids) and each form forced, the products as the rule says (None) or forced."""
    monkeypatch.setattr(decode_module, "IDS_IN_REGISTERS", ids_in_registers)
    monkeypatch.setattr(decode_module, "F16_DOT", f16_dot)
    lens = [context - 7 * i % 50 for i in range(batch)]
    k_cache, v_cache, tables, k_scale, v_scale = _fp8_paged_kv(lens, 16, num_kv_heads, 128, "cuda")
    q = torch.randn(batch, num_q_heads, 128, device="cuda", dtype=torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = decode_attention(q, k_cache, v_cache, tables, lens_t, 128**-0.5, None, k_scale, v_scale)
    expected = _expected_decode(q, k_cache, v_cache, tables, lens_t, k_scale, v_scale, None)
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


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


@gpu
@requires_cuda
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(32, 32, 128), (32, 8, 128), (32, 8, 64)])
@pytest.mark.parametrize("chunk", [False, True])
def test_gpu_prefill_attention_real_shapes(num_q_heads, num_kv_heads, head_dim, chunk):
    """One 2048-token prompt in one chunk, and 1024 new tokens after 1024 cached ones, beside short rows."""
    for seq_lens, q_lens in (([2048], [2048]), ([2048, 300, 17], [1024, 300, 1])):
        out, expected = _prefill(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16, None,
                                 chunk, device=torch.device("cuda"))
        assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@gpu
@requires_cuda
def test_gpu_block_copy_fp8_pool():
    pool = torch.randn(32, 2, 256, 16, 8, 128, device="cuda").to(F8)
    ids = torch.randperm(256, device="cuda")[:100]
    staging = gather_blocks(pool, ids)
    assert torch.equal(_codes(staging), _codes(pool[:, :, ids]))
    other = torch.zeros_like(pool)
    scatter_blocks(other, ids, staging)
    assert torch.equal(_codes(other[:, :, ids]), _codes(pool[:, :, ids]))


def test_v_dequant_reads_v_by_ldmatrix_in_the_sm90_ptx():
    """fp8_attention_ptx_check.py compiles the FP8 cache forms for sm90 (outside the interpreter):
    V_DEQUANT and F16_DOT read V by transposing ldmatrix, F16_DOT widens with one conversion per
    two codes and multiplies on fp16 tensor cores."""
    assert "ok: the FP8 cache's V operand reads" in run_ptx_check("fp8_attention_ptx_check.py")
