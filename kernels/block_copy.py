"""Gather / scatter of whole KV blocks for transfers (Triton).

kv_pool is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
the staging tensor is [num_layers, 2, n, block_size, num_kv_heads, head_dim].
A block of one layer and one of k/v is block_size * num_kv_heads * head_dim
contiguous elements, so both directions are a strided memcpy of such chunks.
An FP8 pool is copied as its bytes (a uint8 view): the copy is bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, block_ids_ptr,
    num_kv,  # num_layers * 2
    src_stride_layer, src_stride_kv, src_stride_block,
    dst_stride_layer, dst_stride_kv, dst_stride_block,
    block_numel,
    GATHER: tl.constexpr, BLOCK: tl.constexpr,
):
    """One chunk of one block:  dst[l, kv, j] = src[l, kv, ids[j]]        (GATHER)
                              dst[l, kv, ids[j]] = src[l, kv, j]        (scatter)

    axis 0 = j * cdiv(block_numel, BLOCK) + chunk, axis 1 = l * 2 + kv.
    """
    num_chunks = tl.cdiv(block_numel, BLOCK)
    pid = tl.program_id(0)
    j = pid // num_chunks
    chunk = pid % num_chunks
    lkv = tl.program_id(1)
    layer = (lkv // 2).to(tl.int64)
    kv = (lkv % 2).to(tl.int64)
    pool_block = tl.load(block_ids_ptr + j).to(tl.int64)
    if GATHER:
        src_block = pool_block
        dst_block = j.to(tl.int64)
    else:
        src_block = j.to(tl.int64)
        dst_block = pool_block
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    src = src_ptr + layer * src_stride_layer + kv * src_stride_kv + src_block * src_stride_block
    dst = dst_ptr + layer * dst_stride_layer + kv * dst_stride_kv + dst_block * dst_stride_block
    vals = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, vals.to(dst_ptr.dtype.element_ty), mask=mask)


# one-byte floats are moved as bytes (no conversion, and no fp8 loads and stores to compile)
_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_blocks_contiguous(t: torch.Tensor, name: str) -> None:
    assert t.dim() == 6 and t.shape[1] == 2, f"{name} must be [L, 2, N, bs, H, D]"
    _, _, _, bs, h, d = t.shape
    assert t.stride(5) == 1 and t.stride(4) == d and t.stride(3) == h * d, (
        f"{name}: each block must be contiguous (bs, H, D)"
    )


def _launch_copy_blocks(src, dst, block_ids, gather: bool) -> None:
    _check_blocks_contiguous(src, "source")
    _check_blocks_contiguous(dst, "destination")
    if src.dtype == dst.dtype and src.dtype in _BYTE_FLOATS:
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    assert src.shape[3:] == dst.shape[3:] and src.shape[:2] == dst.shape[:2]
    assert block_ids.dim() == 1 and block_ids.device == src.device
    num_ids = block_ids.shape[0]
    num_kv = src.shape[0] * 2
    if num_ids == 0 or num_kv == 0:
        return
    assert num_kv <= 65535, "too many layers for grid axis 1"
    block_numel = src.shape[3] * src.shape[4] * src.shape[5]
    block = min(4096, triton.next_power_of_2(block_numel))
    grid = (num_ids * triton.cdiv(block_numel, block), num_kv)
    _copy_blocks_kernel[grid](
        src, dst, block_ids, num_kv,
        src.stride(0), src.stride(1), src.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        block_numel,
        GATHER=gather, BLOCK=block, num_warps=4 if block >= 1024 else 1,
    )


def gather_blocks(kv_pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """kv_pool[:, :, block_ids] as a staging tensor [L, 2, n, bs, H, D]: ``out`` (any layout whose
    blocks are contiguous, e.g. a block-major buffer's ``movedim(0, 2)``), else a new contiguous one."""
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_pool.shape
    shape = (num_layers, 2, block_ids.shape[0], block_size, num_kv_heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=kv_pool.dtype, device=kv_pool.device)
    assert tuple(out.shape) == shape and out.dtype == kv_pool.dtype, f"out must be {shape} of {kv_pool.dtype}"
    _launch_copy_blocks(kv_pool, out, block_ids, gather=True)
    return out


def scatter_blocks(kv_pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """kv_pool[:, :, block_ids] = staging (in place)."""
    assert staging.shape[2] == block_ids.shape[0], "staging must hold one entry per block id"
    _launch_copy_blocks(staging, kv_pool, block_ids, gather=False)
