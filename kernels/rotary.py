"""Rotary embedding fused with the paged KV-cache write (Triton).

One program handles one token: it rotates all its query heads and key heads
(rotate-half / NeoX style), returns them, and writes the rotated key and the
value into the token's cache slot unless the slot is -1 (CUDA-graph padding).
An FP8 cache gets their E4M3 codes under the layer's per-head scales (``kernels.fp8_kv``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_kv import check_scales, is_fp8, quantize_kv_fp8, soft_round
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_src_h, stride_dst_h, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate [num_heads, 2 * HALF] at src into dst; return (x1', x2') in the source dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    src = src_ptr + heads * stride_src_h + cols
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    r1 = (x1f * cos - x2f * sin).to(x1.dtype)
    r2 = (x2f * cos + x1f * sin).to(x1.dtype)
    dst = dst_ptr + heads * stride_dst_h + cols
    tl.store(dst, r1, mask=mask)
    tl.store(dst + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _rotary_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    q_out_ptr, k_out_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_qo_t, stride_qo_h, stride_ko_t, stride_ko_h,
    stride_cs,
    stride_kc_block, stride_kc_slot, stride_kc_h,
    stride_vc_block, stride_vc_slot, stride_vc_h,
    num_q_heads, num_kv_heads, block_size,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, USE_PDL: tl.constexpr = False,
    KV_FP8: tl.constexpr = False, SOFT_ROUND: tl.constexpr = False,
):
    """Token t at position p, with c = cos_sin[p, :HALF], s = cos_sin[p, HALF:]:
        rot(x) = [x1 * c - x2 * s, x2 * c + x1 * s]   (x = [x1 | x2], fp32 math)
        q_out[t] = rot(q[t]);  k_out[t] = rot(k[t])
        if slot[t] >= 0:  k_cache[slot // bs, slot % bs] = k_out[t];  v_cache[...] = v[t]
    KV_FP8: the cache gets quantize_kv_fp8(k_out[t], k_scale[h]) and quantize_kv_fp8(v[t], v_scale[h]).
    """
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + cols).to(tl.float32)  # [1, HALF]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + cols).to(tl.float32)

    _rotate_heads(q_ptr + t * stride_q_t, q_out_ptr + t * stride_qo_t, stride_q_h, stride_qo_h,
                  num_q_heads, cos, sin, HALF, BLOCK_HQ)
    k1, k2 = _rotate_heads(k_ptr + t * stride_k_t, k_out_ptr + t * stride_ko_t, stride_k_h, stride_ko_h,
                           num_kv_heads, cos, sin, HALF, BLOCK_HK)

    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, BLOCK_HK)[:, None]
        mask = heads < num_kv_heads
        kc = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_h + cols
        v_src = v_ptr + t * stride_v_t + heads * stride_v_h + cols
        vc = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_h + cols
        v1 = tl.load(v_src, mask=mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
        if KV_FP8:
            k_scale = tl.load(k_scale_ptr + heads, mask=mask, other=1.0)  # [BLOCK_HK, 1]
            v_scale = tl.load(v_scale_ptr + heads, mask=mask, other=1.0)
            tl.store(kc, quantize_kv_fp8(k1, k_scale, SOFT_ROUND), mask=mask)
            tl.store(kc + HALF, quantize_kv_fp8(k2, k_scale, SOFT_ROUND), mask=mask)
            tl.store(vc, quantize_kv_fp8(v1, v_scale, SOFT_ROUND), mask=mask)
            tl.store(vc + HALF, quantize_kv_fp8(v2, v_scale, SOFT_ROUND), mask=mask)
        else:
            tl.store(kc, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(kc + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(vc + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _launch_rotary_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out, k_out,
                            k_scale=None, v_scale=None):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of 2 >= 16"
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and v.shape == k.shape
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name}: head_dim must be contiguous"
    assert q.dtype == k.dtype, "q and k must share a dtype"
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale, num_kv_heads)
    if num_tokens == 0:
        return
    block_hq = triton.next_power_of_2(num_q_heads)
    block_hk = triton.next_power_of_2(num_kv_heads)
    half = head_dim // 2
    num_warps = max(1, min(8, block_hq * half // 512))
    _rotary_kv_write_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out, k_out, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q_heads, num_kv_heads, k_cache.shape[1],
        HALF=half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, KV_FP8=is_fp8(k_cache), SOFT_ROUND=soft_round(),
        num_warps=num_warps, **launch_options(q),
    )


def rotary_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """ops.rotary_kv_write in one Triton launch."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, num_q_heads, head_dim]
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [num_tokens, num_kv_heads, head_dim]
    _launch_rotary_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out, k_out,
                            k_scale, v_scale)
    return q_out, k_out
