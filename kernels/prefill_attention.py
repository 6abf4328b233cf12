"""Causal variable-length flash attention over paged KV (prefill, chunked context).

Sequence b owns queries query_start_loc[b]:query_start_loc[b+1]; they are the
last q_len of its seq_len positions, whose keys/values (cached context plus
the new chunk, already written) live in the blocks listed in block_tables[b].
With chunk_kv the new chunk's keys/values are read from those tensors instead
(the same values, contiguous rows), and only the context's from the blocks.

Tiling: one program = BLOCK_M queries of one sequence x one query head. Query
tiles of all sequences are laid out on one grid axis without a host sync: the
tiles of sequence b start at query_start_loc[b] // BLOCK_M + b, so
num_tokens // BLOCK_M + num_seqs programs always suffice; a program finds its
sequence by binary search and spare programs exit at once. The grid is (heads,
tiles) with the tiles numbered from the last (HEAVY_FIRST): the query tiles that
see the most keys start first and the short ones fill the tail. Keys are visited in
BLOCK_N tiles from the first one any query of the tile can see (sliding window)
to the diagonal; tiles that every query sees whole run without a mask, the
others (window edge, diagonal) with one, and fully masked tiles are never
visited: over the context (no diagonal) and over the chunk in chunk-index space
(causal), or over all positions at once without chunk_kv. A cached key's address
comes from the block table, so any block size works; a chunk key's is affine in
its index, so Triton overlaps a tile's loads with the previous tile's math.
Online softmax in the exp2 domain, fp32 accumulators.

An FP8 cache (kernels.fp8_kv) is read as E4M3 codes widened to q's dtype in registers; the KV
head's K scale is folded into the context tiles' softmax scale and its V scale multiplies the
accumulator once the context is done (the chunk's own keys and values, with chunk_kv, are
the unquantized rows and need neither).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.dot import dot, upcast_bf16_dot
from tandem.kernels.fp8_kv import is_fp8
from tandem.kernels.paged_checks import check_paged_attention

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_M: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_M + b <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_kv_tile(
    acc, l_i, m_i, q, start_n, q_idx, kv_end, window,
    k_base, v_base, block_table_row, stride_k_block, stride_k_row, stride_v_block, stride_v_row,
    block_size, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """One online-softmax step over keys start_n .. start_n + BLOCK_N - 1 (log2 domain), those
    from kv_end on masked; key n is visible to query row r if n <= q_idx[r] (and, with a
    window, q_idx[r] - n < window). PAGED: key n's row is found through the block table;
    else it is row n of a contiguous [rows, heads, HEAD_DIM] tensor (addresses affine in n,
    so the loop's loads pipeline without a dependent load). KV_FP8: k and v are E4M3 codes,
    widened here; qk_scale carries the K scale, the caller applies the V scale."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_valid = offs_n < kv_end
    if PAGED:
        if MASKED:
            block_ids = tl.load(block_table_row + offs_n // block_size, mask=kv_valid, other=0).to(tl.int64)
        else:
            block_ids = tl.load(block_table_row + offs_n // block_size).to(tl.int64)
        slots = (offs_n % block_size).to(tl.int64)
        k_rows = block_ids * stride_k_block + slots * stride_k_row  # [BLOCK_N]
        v_rows = block_ids * stride_v_block + slots * stride_v_row
    else:
        k_rows = offs_n.to(tl.int64) * stride_k_row
        v_rows = offs_n.to(tl.int64) * stride_v_row
    k_ptrs = k_base + k_rows[None, :] + offs_d[:, None]  # [HEAD_DIM, BLOCK_N]
    v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
    if MASKED:
        k = tl.load(k_ptrs, mask=kv_valid[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
    if KV_FP8:
        k = k.to(q.dtype)
    s = dot(q, k, DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (offs_n[None, :] <= q_idx[:, None]) & kv_valid[None, :]
        if HAS_WINDOW:
            visible = visible & ((q_idx[:, None] - offs_n[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))
    # m_i starts finite, so a row with no visible key here keeps alpha = 1, p = 0
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=kv_valid[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


@triton.jit
def _attend_key_range(
    acc, l_i, m_i, q, lo, full_lo, full_hi, hi, q_idx, kv_end, window,
    k_base, v_base, block_table_row, stride_k_block, stride_k_row, stride_v_block, stride_v_row,
    block_size, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Key tiles from lo to hi: those in [full_lo, full_hi) every query of the tile sees whole
    (no mask); the others (window edge, diagonal, the end) with one."""
    for start_n in range(lo, full_lo, BLOCK_N):  # window edge
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, start_n, q_idx, kv_end, window, k_base, v_base, block_table_row,
            stride_k_block, stride_k_row, stride_v_block, stride_v_row, block_size, qk_scale,
            BLOCK_N, HEAD_DIM, True, HAS_WINDOW, PAGED, DOT_PRECISION, DOT_UPCAST, KV_FP8)
    for start_n in range(full_lo, full_hi, BLOCK_N):  # seen whole by every query
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, start_n, q_idx, kv_end, window, k_base, v_base, block_table_row,
            stride_k_block, stride_k_row, stride_v_block, stride_v_row, block_size, qk_scale,
            BLOCK_N, HEAD_DIM, False, HAS_WINDOW, PAGED, DOT_PRECISION, DOT_UPCAST, KV_FP8)
    for start_n in range(full_hi, hi, BLOCK_N):  # diagonal or the last, partial tile
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, start_n, q_idx, kv_end, window, k_base, v_base, block_table_row,
            stride_k_block, stride_k_row, stride_v_block, stride_v_row, block_size, qk_scale,
            BLOCK_N, HEAD_DIM, True, HAS_WINDOW, PAGED, DOT_PRECISION, DOT_UPCAST, KV_FP8)
    return acc, l_i, m_i


@triton.jit
def _causal_key_range(first, last, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Queries at indices first..last over keys in the same index space: [lo, hi) is what some
    query sees, [full_lo, full_hi) what all of them see (tile-aligned but for hi)."""
    hi = last + 1
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    else:
        lo = 0
        full_lo = 0
    full_hi = tl.maximum((first + 1) // BLOCK_N * BLOCK_N, full_lo)
    return lo, full_lo, full_hi, hi


# vary per step: one binary for every value, not one per value class; the per-sequence arrays are
# read one entry at a time, so their alignment (a step's prompt rows are a slice of its arrays,
# after its decode rows) is no reason for a binary of its own (tests/engine/test_warm_up_coverage.py)
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    k_chunk_ptr, v_chunk_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_bt,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    stride_kc_t, stride_kc_h, stride_vc_t, stride_vc_h,
    num_seqs, qk_scale, window, block_size,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, HAS_CHUNK: tl.constexpr = False, KV_FP8: tl.constexpr = False,
):
    """out[i, h] = sum_p softmax_p(scale * q[i, h] . k[p, h // GROUP]) v[p, h // GROUP]

    over the keys p of query i's sequence with p <= pos(i) and, with a window W,
    pos(i) - p < W; pos(i) = seq_len - q_len + (i - query_start). HAS_CHUNK: the keys and
    values at the chunk's own positions (p = seq_len - q_len + j) are read from rows
    query_start + j of k_chunk, v_chunk; only the cached context's go through the block table.
    KV_FP8: the cache holds E4M3 codes of k / k_scale[kv head] and v / v_scale[kv head].
    """
    if HEAVY_FIRST:  # grid (heads, tiles), last tiles (the most keys) first: a shorter tail
        head = tl.program_id(0)
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        tile = tl.program_id(0)
        head = tl.program_id(1)
    seq = tl.maximum(_find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_M), 0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_M + seq)
    if (q_tile < 0) | (q_tile * BLOCK_M >= q_len):  # a spare program
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_valid = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
                mask=q_valid[:, None], other=0.0)
    q_pos = context_len + offs_m
    i_first = q_tile * BLOCK_M  # the tile's first and last query, as chunk indices
    i_last = tl.minimum((q_tile + 1) * BLOCK_M, q_len) - 1

    kv_head = head // GROUP
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    else:
        k_scale = 1.0
        v_scale = 1.0
    # key positions some / all queries of the tile see
    lo, full_lo, full_hi, hi = _causal_key_range(context_len + i_first, context_len + i_last, window,
                                                 BLOCK_N, HAS_WINDOW)
    if HAS_CHUNK:
        # the cached context, seen by every query but for the window: no diagonal
        ctx_full_lo = tl.minimum(full_lo, context_len)
        ctx_full_hi = tl.maximum(context_len // BLOCK_N * BLOCK_N, ctx_full_lo)
        acc, l_i, m_i = _attend_key_range(
            acc, l_i, m_i, q, lo, ctx_full_lo, ctx_full_hi, context_len, q_pos, context_len, window,
            k_base, v_base, block_table_row, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            block_size, qk_scale * k_scale, BLOCK_N, HEAD_DIM, HAS_WINDOW, True, DOT_PRECISION, DOT_UPCAST,
            KV_FP8)
        if KV_FP8:  # the context's sums in real units before the chunk's own (unquantized) values join
            acc = acc * v_scale
        # the chunk's own keys, as chunk indices j (position context_len + j): causal in j
        lo, full_lo, full_hi, hi = _causal_key_range(i_first, i_last, window, BLOCK_N, HAS_WINDOW)
        k_chunk = k_chunk_ptr + q_start.to(tl.int64) * stride_kc_t + kv_head * stride_kc_h
        v_chunk = v_chunk_ptr + q_start.to(tl.int64) * stride_vc_t + kv_head * stride_vc_h
        acc, l_i, m_i = _attend_key_range(
            acc, l_i, m_i, q, lo, full_lo, full_hi, hi, offs_m, q_len, window,
            k_chunk, v_chunk, block_table_row, 0, stride_kc_t, 0, stride_vc_t,
            block_size, qk_scale, BLOCK_N, HEAD_DIM, HAS_WINDOW, False, DOT_PRECISION, DOT_UPCAST)
    else:
        acc, l_i, m_i = _attend_key_range(
            acc, l_i, m_i, q, lo, full_lo, full_hi, hi, q_pos, seq_len, window,
            k_base, v_base, block_table_row, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            block_size, qk_scale * k_scale, BLOCK_N, HEAD_DIM, HAS_WINDOW, True, DOT_PRECISION, DOT_UPCAST,
            KV_FP8)
        if KV_FP8:
            acc = acc * v_scale

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only rows past the sequence's end
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])


HEAVY_FIRST = True  # grid order (see the kernel): 11-27% faster at 2048 tokens on an H200


def _tile_config(num_tokens: int, num_seqs: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from shapes only (no autotune).

    Long chunks, from ``python3 -m tandem.bench.tune_prefill_attention`` (H200, 2048 tokens,
    heavy-first, chunk_kv): D 128 64x64 tiles, 4 warps, 2 stages (~48 KB of shared memory:
    several programs per SM, whose loads and math overlap one another; within one program at
    two stages the next tile's loads wait for the current tile's math, sm90 TTGIR); D 64
    128x64, 4 warps, 3 stages."""
    avg_q_len = num_tokens // max(num_seqs, 1)
    block_m = 16
    while block_m < 128 and block_m < avg_q_len:
        block_m *= 2
    wide = dtype == torch.float32 or head_dim > 128  # keep q + 2 stages of k, v in shared memory
    if wide:
        return min(block_m, 64), 32, 4, 2
    if block_m < 128:
        return block_m, 64, 4, 2
    if head_dim == 128:
        return 64, 64, 4, 2
    return 128, 64, 4, 3


def _launch_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, sliding_window,
                              chunk_kv=None, config: tuple | None = None, k_scale=None, v_scale=None):
    """``config``: (BLOCK_M, BLOCK_N, num_warps, num_stages, heavy_first) instead of
    the shape rule (tuning only). ``k_scale``, ``v_scale``: an FP8 cache's [num_kv_heads]
    fp32 scales of this layer."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    k_scale, v_scale = check_paged_attention(q, k_cache, v_cache, block_tables, out, sliding_window, k_scale, v_scale)
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    if chunk_kv is not None:
        k_chunk, v_chunk = chunk_kv
        assert k_chunk.shape == v_chunk.shape == (num_tokens, num_kv_heads, head_dim), \
            "chunk_kv: [num_tokens, num_kv_heads, head_dim] each"
        assert k_chunk.dtype == v_chunk.dtype == q.dtype, "chunk_kv must share q's dtype"
        assert k_chunk.stride(-1) == 1 and v_chunk.stride(-1) == 1, "chunk_kv: head_dim must be contiguous"
        chunk_strides = (k_chunk.stride(0), k_chunk.stride(1), v_chunk.stride(0), v_chunk.stride(1))
    else:
        k_chunk = v_chunk = q  # unused
        chunk_strides = (0, 0, 0, 0)
    if num_tokens == 0 or num_seqs == 0:
        return
    block_m, block_n, num_warps, num_stages = _tile_config(num_tokens, num_seqs, head_dim, q.dtype)
    heavy_first = HEAVY_FIRST
    if config is not None:
        block_m, block_n, num_warps, num_stages, heavy_first = config
    num_tiles = num_tokens // block_m + num_seqs
    assert not heavy_first or num_tiles <= 65535, "too many query tiles for grid axis 1"
    grid = (num_q_heads, num_tiles) if heavy_first else (num_tiles, num_q_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, k_chunk, v_chunk, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *chunk_strides,
        num_seqs, scale * LOG2E, sliding_window or 0, block_size,
        GROUP=num_q_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=upcast_bf16_dot(q.dtype), HEAVY_FIRST=heavy_first,
        HAS_CHUNK=chunk_kv is not None, KV_FP8=is_fp8(k_cache),
        num_warps=num_warps, num_stages=num_stages,
    )


def prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window=None,
                      chunk_kv=None, k_scale=None, v_scale=None):
    """ops.prefill_attention in one Triton launch."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, num_q_heads, head_dim]
    _launch_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
                              float(scale), sliding_window, chunk_kv, k_scale=k_scale, v_scale=v_scale)
    return out
