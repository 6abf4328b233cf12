"""Decode attention with rotary and the new token's KV write fused in, against the two
references run one after the other (rotary_kv_write, then decode_attention)."""

import pytest
import torch
from kernel_testing import force_ids_in_registers, DEVICE, DTYPES, assert_close, gpu, make_paged_kv, new_token_rows, pairwise, requires_cuda

from tandem.kernels import decode_attention as decode_module
from tandem.kernels import reference
from tandem.kernels.decode_attention import decode_attention_new_token
from tandem.kernels import switches

HEAD_CONFIGS = [(2, 2, 64, 16), (4, 1, 128, 16), (8, 1, 64, 8), (8, 2, 32, 4)]  # GQA 1, 4, 8
ATTN_SCALE = {torch.float32: 1.0, torch.float16: 2.5, torch.bfloat16: 1.5}


def _cos_sin(max_position, head_dim, device):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


def _inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, padded_row):
    """The caches hold every sequence's earlier tokens; the new token's slot is NaN until written."""
    k_cache, v_cache, tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    q, k, v, positions, slots, lens = new_token_rows(seq_lens, tables, k_cache, v_cache, block_size, num_q_heads,
                                                     head_dim, dtype, padded_row)
    return q, k, v, positions, _cos_sin(512, head_dim, DEVICE), k_cache, v_cache, slots, tables, lens


def _check(inputs, dtype, window):
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens = inputs
    head_dim = q.shape[-1]
    ref_k, ref_v = k_cache.float().clone(), v_cache.float().clone()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with q.device:
        expected = reference.decode_attention_new_token(q.float(), k.float(), v.float(), positions, cos_sin, ref_k,
                                                        ref_v, slots, tables, lens, head_dim**-0.5, window)
    out = decode_attention_new_token(q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, lens,
                                     head_dim**-0.5, window)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])
    written = slots[slots >= 0]
    flat = lambda c: c.view(-1, *c.shape[2:])  # noqa: E731
    assert_close(flat(k_cache)[written], flat(ref_k)[written], dtype)  # rotated k and v in the new slots
    assert_close(flat(v_cache)[written], flat(ref_v)[written], dtype)
    others = torch.ones(flat(k_cache).shape[0], dtype=torch.bool, device=k_cache.device)
    others[written] = False
    for cache, before in ((k_cache, k_before), (v_cache, v_before)):  # and nothing else was written
        assert torch.equal(flat(cache)[others].isnan(), flat(before)[others].isnan())
        assert torch.equal(flat(cache)[others].nan_to_num(), flat(before)[others].nan_to_num())


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 20],
    "num_splits": [1, 3, 8],
})
def test_matches_rotary_then_attention(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim, block_size, window,
                                       num_splits):
    """Odd lengths, partial blocks, a padding row, splits empty for short sequences."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    inputs = _inputs([1, 70, 33, 130, 2], num_q_heads, num_kv_heads, head_dim, block_size, dtype, padded_row=4)
    _check(inputs, dtype, window)


@pairwise({
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 100],
    "num_splits": [1, 2, 3],  # 2: a 150-token row's splits hold 2 tiles and 1
})
def test_prefetched_last_tile(monkeypatch, num_q_heads, num_kv_heads, head_dim, block_size, window, num_splits):
    """PREFETCH: each share's last tile loaded first, the new token's k and v put into it from
    registers (no read-back): same output, same cache writes (every batch size here; by
    default batch 1 only)."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    monkeypatch.setattr(decode_module, "PREFETCH", True)
    monkeypatch.setattr(decode_module, "PREFETCH_MAX_BATCH", 1 << 20)
    inputs = _inputs([1, 70, 33, 130, 2, 64, 150], num_q_heads, num_kv_heads, head_dim, block_size,
                     torch.bfloat16, padded_row=4)
    _check(inputs, torch.bfloat16, window)


@pairwise({
    "dtype": [torch.float32, torch.bfloat16],  # 32- and 64-token tiles
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 100],
    "num_splits": [1, 2],
})
def test_block_ids_in_registers(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim, block_size, window,
                                num_splits):
    """Block ids in registers: each tile's block ids taken from the share's entries loaded once; rows at,
    one past and one short of whole tiles, a padding row."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    rule = decode_module._tile_config
    monkeypatch.setattr(decode_module, "_tile_config", lambda *args: (*rule(*args)[:3], True))  # ids forced on
    inputs = _inputs([64, 65, 1, 129, 2, 31, 150], num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                     padded_row=4)
    _check(inputs, dtype, window)


@gpu
@requires_cuda
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("ids_in_registers", [False, True])
@pytest.mark.parametrize("batch, context", [(1, 256), (64, 256), (128, 416)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(32, 32), (32, 8)])
def test_gpu_real_shapes_bf16(batch, context, num_q_heads, num_kv_heads, prefetch, ids_in_registers, monkeypatch):
    monkeypatch.setattr(decode_module, "PREFETCH", prefetch)
    force_ids_in_registers(monkeypatch, ids_in_registers)
    monkeypatch.setattr(decode_module, "PREFETCH_MAX_BATCH", 1 << 20)
    lens = [context - 7 * i % 50 for i in range(batch)]
    inputs = _inputs(lens, num_q_heads, num_kv_heads, 128, 16, torch.bfloat16, padded_row=None)
    _check(inputs, torch.bfloat16, None)


def test_the_model_fuses_small_decode_batches_unless_told(monkeypatch):
    from tandem.kernels import ops

    monkeypatch.delenv("TANDEM_FUSED_ROTARY", raising=False)
    switches.reload()
    assert ops.fused_decode_rotary(1) and ops.fused_decode_rotary(ops.FUSED_ROTARY_MAX_BATCH)
    assert not ops.fused_decode_rotary(ops.FUSED_ROTARY_MAX_BATCH + 1) and not ops.fused_decode_rotary(64)
    monkeypatch.setenv("TANDEM_FUSED_ROTARY", "0")
    switches.reload()
    assert not ops.fused_decode_rotary(1)
    monkeypatch.setenv("TANDEM_FUSED_ROTARY", "1")
    switches.reload()
    assert ops.fused_decode_rotary(64)
    monkeypatch.setenv("TANDEM_FUSED_ROTARY", "true")
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        switches.reload()
