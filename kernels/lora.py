"""Batched LoRA: the shrink (x @ A^T) and expand (y += (s @ B^T) * scale) of a step whose rows
carry different adapters (Triton; the contract is ``ops.lora_add``, its halves
``reference.lora_shrink`` / ``reference.lora_expand``).

The rows of one adapter are a segment (``engine.lora_batch``: the step's rows grouped by
device slot, through ``token_order``). Grid: (segments, row tiles, column tiles); a program
takes up to BLOCK_M rows of its segment, gathers them through ``token_order``, and multiplies
them by its slot's matrix with ``tl.dot``: one weight tile read serves every row of the tile.
Programs past their segment's end (the grid is sized by all the adapter rows, so it depends
on shapes only, never on how the rows split) and segments of slot -1 return at once.

The shrink's reduction runs over the projection's whole input (4,096-14,336 columns) and its
grid is small (a decode step of 64 rows over 8 adapters: 8 programs), so it splits K: each of
``split_k`` programs reduces one K range into its own fp32 partial. ``split_k`` is chosen so
that the grid fills the device's SMs (``_split_k``); on the CPU it is 1 unless a caller asks.
The expand sums the partials in a fixed order as it reads them (deterministic, unlike atomics).

Both kernels launch with PDL where it is on (``kernels.pdl``): each lets its successor launch,
then waits for its predecessor before it reads anything, so the boundaries a LoRA step adds to
the decode step's chain of kernels cost less idle time.

A projection of a decode step is two launches (``lora_add``): one shrink over every part of a
fused projection (q, k and v's A stacked), into partials no fill precedes (rows of no segment are
never read), and one expand over the whole fused output, each column tile adding the parts whose
columns it meets. A decode step's LoRA is then 8 small kernels a layer: its cost is their number
and latency (the adapters' weights are a few MB), so none is spent on fills, sums or per-part
launches.

The shrink multiplies in the activations' dtype with fp32 accumulation (IEEE fp32 products for
fp32) and writes fp32; the expand multiplies the fp32 shrink by B widened to fp32 (the rank is
small), scales, adds to the output in fp32 and rounds once.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tandem.kernels.dot import dot, upcast_bf16_dot
from tandem.kernels.lora_rows import LORA_MOST_SPLITS
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _segment_rows(order_ptr, starts_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """-> (slot, rows' token indices [BLOCK_M] int64, row mask, whether this program has rows)."""
    seg = tl.program_id(0)
    slot = tl.load(slots_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    first = tl.load(starts_ptr + seg) + tl.program_id(1) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    mask = rows < end
    tokens = tl.load(order_ptr + rows, mask=mask, other=0).to(tl.int64)
    return slot, tokens, mask, (slot >= 0) & (first < end)


# The split and the partials' stride follow a step's adapter rows and tokens: one binary for
# every value, not one per value class (tests/engine/test_warm_up_coverage.py)
@triton.jit(do_not_specialize=["K_PER_SPLIT", "stride_split"])
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, slots_ptr,
    R, K, K_PER_SPLIT, NUM_R_TILES, stride_xm, stride_as, stride_ar, stride_om, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    slot, tokens, row_mask, active = _segment_rows(order_ptr, starts_ptr, slots_ptr, BLOCK_M)
    if active:
        split = tl.program_id(2) // NUM_R_TILES
        rs = (tl.program_id(2) % NUM_R_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = rs < R
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        out_ptr += split.to(tl.int64) * stride_split
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_start = split * K_PER_SPLIT
        for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_base + rs[None, :] * stride_ar + ks[:, None],  # [BLOCK_K, BLOCK_R]: A^T's tile
                        mask=r_mask[None, :] & k_mask[:, None], other=0.0)
            acc += dot(x, a, DOT_PRECISION, DOT_UPCAST)
        tl.store(out_ptr + tokens[:, None] * stride_om + rs[None, :], acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _part_bound(i: tl.constexpr, N, OFF1, OFF2, PARTS: tl.constexpr):
    """Column where part i begins (i == PARTS: the end)."""
    if i == 0:
        return 0
    elif i == PARTS:
        return N
    elif i == 1:
        return OFF1
    else:
        return OFF2


@triton.jit(do_not_specialize=["SPLIT", "stride_split", "stride_s_slot"])
def _lora_expand_kernel(
    y_ptr, s_ptr, b_ptr, scales_ptr, order_ptr, starts_ptr, slots_ptr,
    N, R, SPLIT, OFF1, OFF2, stride_ym, stride_sm, stride_split, stride_bs, stride_bn, stride_sp, stride_s_slot,
    PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    slot, tokens, row_mask, active = _segment_rows(order_ptr, starts_ptr, slots_ptr, BLOCK_M)
    if active:
        n0 = tl.program_id(2) * BLOCK_N
        ns = n0 + tl.arange(0, BLOCK_N)
        n_mask = ns < N
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(PARTS):  # the parts whose columns meet this tile
            lo = _part_bound(p, N, OFF1, OFF2, PARTS)
            hi = _part_bound(p + 1, N, OFF1, OFF2, PARTS)
            if (n0 < hi) & (n0 + BLOCK_N > lo):
                cols = n_mask & (ns >= lo) & (ns < hi)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r0 in range(0, R, BLOCK_R):
                    rs = r0 + tl.arange(0, BLOCK_R)
                    r_mask = rs < R
                    s_ptrs = s_ptr + slot * stride_s_slot + tokens[:, None] * stride_sm + (p * R + rs)[None, :]
                    s_mask = row_mask[:, None] & r_mask[None, :]
                    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for i in range(SPLIT):  # the shrink's K ranges, summed in order
                        s += tl.load(s_ptrs + i * stride_split, mask=s_mask, other=0.0).to(tl.float32)
                    b = tl.load(b_base + ns[None, :] * stride_bn + rs[:, None],  # [BLOCK_R, BLOCK_N]: B^T's tile
                                mask=cols[None, :] & r_mask[:, None], other=0.0).to(tl.float32)
                    part += tl.dot(s, b, input_precision="ieee")
                acc += part * tl.load(scales_ptr + p * stride_sp + slot)
        ptrs = y_ptr + tokens[:, None] * stride_ym + ns[None, :]
        mask = row_mask[:, None] & n_mask[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block(n: int, most: int) -> int:
    """A tile side for n: a power of 2 within 16 (tl.dot's least) .. most."""
    return max(16, min(most, triton.next_power_of_2(max(n, 1))))


def _segment_rows_block(num_rows: int, num_segs: int) -> int:
    """The row tile of a program: the rows an average segment holds (a decode step's 64 rows over a
    graph's 8 segments: 16, not a 64-row tile for 8 rows), at least 16 (tl.dot's least) and at most 64.
    Every value is one a single segment of 16, 32 or 64+ rows takes too: the warm-up's steps compile it."""
    return _block(triton.cdiv(num_rows, max(num_segs, 1)), 64)


def _check_segments(token_order: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    assert token_order.dim() == 1 and token_order.is_contiguous()
    assert seg_slots.dim() == 1 and seg_slots.is_contiguous() and seg_starts.is_contiguous()
    assert seg_starts.shape == (seg_slots.shape[0] + 1,)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(x: torch.Tensor, num_programs: int, num_k_blocks: int) -> int:
    """K ranges per program tile: enough programs for two per SM, each at least 4 K blocks."""
    if x.device.type != "cuda":
        return 1
    return max(1, min(num_k_blocks // 4, (2 * _num_sms(x.device)) // max(num_programs, 1)))


def _shrink(x: torch.Tensor, a_stacked: torch.Tensor, segments: tuple, split_k: int | None,
            alloc, most_splits: int | None = None) -> torch.Tensor:
    """The shrink's partial sums, [split, T, R] fp32 (``alloc`` makes the buffer: rows of no
    segment are not written; ``most_splits`` bounds the split chosen)."""
    token_order, seg_starts, seg_slots = segments
    _check_segments(token_order, seg_starts, seg_slots)
    num_tokens, K = x.shape
    _, R, K_a = a_stacked.shape
    assert K_a == K and x.stride(1) == 1 and a_stacked.stride(2) == 1, "x [T, K], a_stacked [L, R, K], rows contiguous"
    assert x.dtype == a_stacked.dtype, "x and the A matrices share a dtype"
    num_rows, num_segs = token_order.shape[0], seg_slots.shape[0]
    if num_rows == 0 or num_segs == 0 or R == 0 or K == 0:
        return torch.zeros((1, num_tokens, R), dtype=torch.float32, device=x.device)
    block_m, block_r, block_k = _segment_rows_block(num_rows, num_segs), _block(R, 64), _block(K, 64)
    r_tiles, k_blocks = triton.cdiv(R, block_r), triton.cdiv(K, block_k)
    programs = num_segs * triton.cdiv(num_rows, block_m) * r_tiles
    split = split_k or min(_split_k(x, programs, k_blocks), most_splits or k_blocks)
    split = max(1, min(split, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    out = alloc((split, num_tokens, R), dtype=torch.float32, device=x.device)
    grid = (num_segs, triton.cdiv(num_rows, block_m), r_tiles * split)
    _lora_shrink_kernel[grid](
        x, a_stacked, out, token_order, seg_starts, seg_slots,
        R, K, k_per_split, r_tiles, x.stride(0), a_stacked.stride(0), a_stacked.stride(1), out.stride(1),
        out.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", DOT_UPCAST=upcast_bf16_dot(x.dtype),
        num_warps=4, **launch_options(x),
    )
    return out


def _expand(y: torch.Tensor, partials: torch.Tensor, b_stacked: torch.Tensor, scales: torch.Tensor,
            offsets: list[int], segments: tuple, slot_stride: int = 0) -> None:
    """y += the expand of every part (``offsets``: each part's first column of y; its rank's columns
    of ``partials`` [split, T, parts * R], summed over the split) in one launch. ``slot_stride``:
    partials is [1, T, slots * parts * R] (any float dtype), a row of slot s reading its columns
    from s * slot_stride (the shrink of every slot, from a fused weight: engine.lora_weights)."""
    token_order, seg_starts, seg_slots = segments
    _check_segments(token_order, seg_starts, seg_slots)
    num_tokens, N = y.shape
    _, N_b, R = b_stacked.shape
    parts = len(offsets)
    assert 1 <= parts <= 3 and offsets[0] == 0 and list(offsets) == sorted(offsets) and offsets[-1] < max(N, 1)
    width = parts * R * (b_stacked.shape[0] if slot_stride else 1)
    assert N_b == N and partials.shape[1:] == (num_tokens, width), "y [T, N], partials [S, T, P*R], b [L, N, R]"
    assert not slot_stride or (slot_stride == parts * R and partials.shape[0] == 1)
    assert y.stride(1) == 1 and partials.stride(2) == 1 and b_stacked.stride(2) == 1, "columns contiguous"
    assert (slot_stride or partials.dtype == torch.float32) and scales.dtype == torch.float32 and scales.stride(-1) == 1
    num_rows, num_segs = token_order.shape[0], seg_slots.shape[0]
    if num_rows == 0 or num_segs == 0 or N == 0 or R == 0:
        return
    bounds = list(offsets[1:]) + [N] * (3 - parts)
    block_m, block_n = _segment_rows_block(num_rows, num_segs), 64
    grid = (num_segs, triton.cdiv(num_rows, block_m), triton.cdiv(N, block_n))
    _lora_expand_kernel[grid](
        y, partials, b_stacked, scales, token_order, seg_starts, seg_slots,
        N, R, partials.shape[0], bounds[0], bounds[1], y.stride(0), partials.stride(1), partials.stride(0),
        b_stacked.stride(0), b_stacked.stride(1), scales.stride(0) if scales.dim() == 2 else 0, slot_stride,
        PARTS=parts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block(R, 64),
        num_warps=4, **launch_options(y),
    )


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """As ``reference.lora_shrink``. ``split_k``: K ranges reduced apart (module docstring;
    None chooses)."""
    out = _shrink(x, a_stacked, (token_order, seg_starts, seg_slots), split_k, torch.zeros)
    return out[0] if out.shape[0] == 1 else out.sum(0)


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, b_stacked: torch.Tensor, token_order: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, scales: torch.Tensor) -> None:
    """As ``reference.lora_expand`` (in place on ``y``)."""
    assert shrunk.dim() == 2 and scales.dim() == 1 and scales.is_contiguous()
    _expand(y, shrunk.unsqueeze(0), b_stacked, scales, [0], (token_order, seg_starts, seg_slots))


# lora_add's shrink splits K at most this many ways: every expand program reads all the partials
# of its rows, so a split that fills the SMs for down_proj's 14,336 inputs (56 ranges) would
# multiply the expand's reads by as much.
ADD_MOST_SPLITS = 8


def lora_add(y: torch.Tensor, x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor,
             offsets: list[int], scales: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
             seg_slots: torch.Tensor, split_k: int | None = None) -> None:
    """As ``reference.lora_add``, in two launches: the shrink of every part into split-K partials
    (no fill: rows of no segment are never read) and one expand over every part that sums them."""
    segments = (token_order, seg_starts, seg_slots)
    partials = _shrink(x, a_stacked, segments, split_k, torch.empty, most_splits=ADD_MOST_SPLITS)
    _expand(y, partials, b_stacked, scales, offsets, segments)


def lora_partials(x: torch.Tensor, a_stacked: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
                  seg_slots: torch.Tensor) -> torch.Tensor:
    """lora_add's shrink alone (ops.lora_partials): [split, T, R] partials. The kernel after the
    projection reads each row's own partials in one load, so K splits as far as the SMs fill
    (down_proj's 14,336 inputs: about 33 ranges of 7 tiles, where lora_add's 8 take 28 tiles each)."""
    return _shrink(x, a_stacked, (token_order, seg_starts, seg_slots), None, torch.empty, most_splits=LORA_MOST_SPLITS)


def lora_expand_slots(y: torch.Tensor, shrunk: torch.Tensor, b_stacked: torch.Tensor, offsets: list[int],
                      scales: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
                      seg_slots: torch.Tensor) -> None:
    """As ``reference.lora_expand_slots``: lora_add's expand from every slot's shrink [T, L * P * R]."""
    rank = b_stacked.shape[2]
    _expand(y, shrunk.unsqueeze(0), b_stacked, scales, offsets, (token_order, seg_starts, seg_slots),
            slot_stride=len(offsets) * rank)
