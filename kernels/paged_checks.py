"""The argument checks both paged-attention launchers share (prefill and decode attention),
written once: a paged K/V cache, the queries that read it and the output they write."""

from __future__ import annotations

import torch

from tandem.kernels.fp8_kv import check_scales, is_fp8


def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          out: torch.Tensor, sliding_window: int | None, k_scale, v_scale):
    """q [rows, num_q_heads, head_dim], caches [num_blocks, block_size, num_kv_heads, head_dim] of
    q's dtype or FP8 (with their scales), block table rows contiguous. -> (k_scale, v_scale) as a
    kernel takes them (``fp8_kv.check_scales``)."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of 2 >= 16"
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert k_cache.dtype == v_cache.dtype and (q.dtype == k_cache.dtype or is_fp8(k_cache)), \
        "the cache must hold q's dtype or FP8"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        assert t.stride(-1) == 1, f"{name}: head_dim must be contiguous"
    assert sliding_window is None or sliding_window > 0
    return check_scales(k_cache, k_scale, v_scale, num_kv_heads)
