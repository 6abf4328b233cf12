"""Paged decode attention's two Triton kernels: split-KV (flash-decoding) with GQA grouping.

Phase 1 (``_decode_partial_kernel``), grid (num_kv_heads, num_seqs, num_splits): one program
takes all GROUP query heads that share one KV head, so each key/value is read once per
group, and attends them to an equal share of the sequence's visible keys
(its last sliding_window keys, or all of them). It writes a partial result
per split: the normalized output and log2-sum-exp. Phase 2 (``_decode_reduce_kernel``), grid
(num_seqs, num_q_heads), merges the splits. With one split, phase 1 writes the output
directly and phase 2 is skipped. The KV head is the grid's fastest axis, so
the programs running at one time read the heads of the same tokens: the
cache's [block, slot, head, dim] layout puts them side by side in memory.

An FP8 cache (kernels.fp8_kv) is read as E4M3 codes widened to q's dtype in registers; the
program's KV head scales multiply its scores (K, folded into the softmax scale) and its
output (V), and the fused form writes the new token's codes. The launch (which kernel form,
splits, tiles) is ``kernels.decode_attention``'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.kernels.decode_tiles import (_attend_kv_tile, _attend_tile, _cache_new_kv, _f16_query,
                                         _f16_value_scale, _fp8_query, _load_kv_tile, _rotated_new_kv,
                                         _store_new_kv)
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait


# A step's table width and split count vary with its rows and contexts (a step with prompt chunks
# runs this launch eagerly): one binary for every value, not one per value class (1, a multiple
# of 16, other), so traffic compiles nothing its warm-up did not (tests/engine/test_warm_up_coverage.py).
@triton.jit(do_not_specialize=["stride_bt", "num_splits", "num_table_blocks"])
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    partial_out_ptr, partial_lse_ptr, out_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_s, stride_q_h, stride_bt,
    stride_kn_s, stride_kn_h, stride_vn_s, stride_vn_h, stride_cs,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h,
    stride_o_s, stride_o_h,
    qk_scale, window, block_size, num_splits, num_table_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    HEADS_FIRST: tl.constexpr, NEW_TOKEN: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, IDS_REG: tl.constexpr = 0,
    KV_FP8: tl.constexpr = False, SOFT_ROUND: tl.constexpr = False, V_DEQUANT: tl.constexpr = False,
    F16_DOT: tl.constexpr = False, REG_PREFETCH: tl.constexpr = False, FP8_QK: tl.constexpr = False,
):
    """Keys [lo, seq_len) with lo = max(seq_len - W, 0) (or 0) are cut into num_splits
    shares of whole BLOCK_N tiles; split j over its share P_j, for each head h of the group:
        m = max_p s_p,  s_p = scale * log2(e) * q[h] . k[p]
        partial_out[h, j] = sum_p 2^(s_p - m) v[p] / sum_p 2^(s_p - m)
        partial_lse[h, j] = m + log2(sum_p 2^(s_p - m))       (-inf if P_j is empty)
    NEW_TOKEN (rotary and the KV write fused in): q is unrotated; with p = positions[s],
    c = cos_sin[p, d % D/2], s' = cos_sin[p, D/2 + d % D/2] and x~[d] = x[(d + D/2) % D],
        rot(x)[d] = x[d] c - x~[d] s'  (d < D/2),   x[d] c + x~[d] s'  (d >= D/2)
    q is replaced by rot(q); the split holding position seq_len - 1 writes rot(k_new) and
    v_new into the cache slot slot_mapping[s] (unless -1) and attends to them: read back after
    a barrier, or with PREFETCH taken from registers, so that the share's last tile (which
    holds that position) can be loaded before waiting for the previous kernel (PDL: the cache,
    block tables and lengths are not written by the kernels before it in the step). A decode
    row has seq_len >= 1. The GPU compiler may contract the multiply-adds differently from
    kernels.rotary: about 1 value in 50,000 differs by 1 bf16 ulp from the unfused path.
    IDS_REG > 0: the block table entries of the share (IDS_REG of them from the share's first
    block; with one split and no window from entry 0, so before seq_len is read) are loaded once.
    KV_FP8: the cache holds E4M3 codes of k / k_scale[kv_head] and v / v_scale[kv_head]; the
    scores are q . code * scale * log2(e) * k_scale, the output is multiplied by v_scale, and
    the new token (NEW_TOKEN) is written and attended as its codes. F16_DOT (with KV_FP8, a 16-bit
    q): both products in fp16 (decode_tiles._attend_kv_tile), the score scale folded into q.
    REG_PREFETCH (not with PREFETCH; a tuning form): each tile's loads are issued before the
    previous tile's math, into registers the loop carries, so a program's loads overlap its math
    (Triton's 2-stage pipeline waits for a tile's copies and issues the next tile's after the math).
    FP8_QK (with KV_FP8 and F16_DOT, not with PREFETCH; a tuning form): the scores from an E4M3
    product, q quantized per head (decode_tiles._fp8_query) and K's codes read as the cache's rows,
    so that no K code is widened (on sm90 a wgmma over E4M3); P.V as F16_DOT's.
    """
    tl.static_assert(not FP8_QK or (KV_FP8 and F16_DOT and not PREFETCH), "FP8_QK: an FP8 cache, F16_DOT's V")
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        if not PREFETCH:
            gdc_wait()
    if HEADS_FIRST:  # programs launched together read neighbouring heads of the same tokens
        kv_head = tl.program_id(0)
        seq = tl.program_id(1).to(tl.int64)
    else:
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    block_table_row = block_tables_ptr + seq * stride_bt
    if IDS_REG > 0 and DIRECT_OUT and not HAS_WINDOW:  # the share starts at 0: no wait for seq_len
        offs_ids = tl.arange(0, IDS_REG)
        ids_first = 0
        ids = tl.load(block_table_row + offs_ids, mask=offs_ids < num_table_blocks, other=0)
    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    share = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * share
    end = tl.minimum(start + share, seq_len)
    if IDS_REG > 0 and not (DIRECT_OUT and not HAS_WINDOW):
        offs_ids = tl.arange(0, IDS_REG)
        ids_first = start // block_size
        ids = tl.load(block_table_row + ids_first + offs_ids, mask=ids_first + offs_ids < num_table_blocks, other=0)
    if IDS_REG == 0:
        ids_first = 0
        ids = 0
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head
    if PREFETCH:  # the share's last tile, before the wait
        count = tl.maximum(end - start, 0)
        last_tile = start + tl.maximum(tl.cdiv(count, BLOCK_N) - 1, 0) * BLOCK_N
        k_last, v_last, offs_last, valid_last = _load_kv_tile(
            k_base, v_base, block_table_row, last_tile, end,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, block_size, BLOCK_N, HEAD_DIM)
        if USE_PDL:
            gdc_wait()
    if KV_FP8:  # after the wait, as every argument but the cache and its tables
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
        qk_scale = qk_scale * k_scale
    else:
        k_scale = 1.0
        v_scale = 1.0

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    head_valid = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=head_valid[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    if NEW_TOKEN:
        half_d = offs_d % (HEAD_DIM // 2)
        partner_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        pos = tl.load(positions_ptr + seq).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + half_d).to(tl.float32)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HEAD_DIM // 2 + half_d).to(tl.float32)[None, :]
        sin = tl.where(offs_d[None, :] < HEAD_DIM // 2, -sin, sin)
        q_partner = tl.load(q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + partner_d[None, :],
                            mask=head_valid[:, None], other=0.0)
        q = (q.to(tl.float32) * cos + q_partner.to(tl.float32) * sin).to(q.dtype)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        last = seq_len - 1
        writes = (slot >= 0) & (start <= last) & (last < end)  # this split attends to the new token
        k_row = k_new_ptr + seq * stride_kn_s + kv_head * stride_kn_h
        v_row = v_new_ptr + seq * stride_vn_s + kv_head * stride_vn_h
        k_slot = k_base + (slot // block_size) * stride_k_block + (slot % block_size) * stride_k_slot
        v_slot = v_base + (slot // block_size) * stride_v_block + (slot % block_size) * stride_v_slot
        if PREFETCH:  # every split: the new token's k and v go into the prefetched tile from registers
            k_rot, v_new = _rotated_new_kv(k_row, v_row, cos, sin, partner_d, q.dtype, HEAD_DIM)
            k_rot, v_new = _cache_new_kv(k_rot, v_new, k_scale, v_scale, KV_FP8, SOFT_ROUND)
            if writes:
                _store_new_kv(k_slot, v_slot, k_rot, v_new, HEAD_DIM)
            is_last = (offs_last == last) & (slot >= 0)  # a padding row (slot -1) reads what is there
            if KV_FP8 and F16_DOT:  # the tile widened here, the codes selected in fp16
                k_last = k_last.to(tl.float16)
                v_last = v_last.to(tl.float16)
            elif KV_FP8:  # the tile widened here, the codes selected in q's dtype
                k_last = k_last.to(q.dtype)
                v_last = v_last.to(q.dtype)
            k_last = tl.where(is_last[None, :], tl.trans(k_rot).to(k_last.dtype), k_last)
            v_last = tl.where(is_last[:, None], v_new[None, :].to(v_last.dtype), v_last)
        else:
            if writes:
                k_rot, v_new = _rotated_new_kv(k_row, v_row, cos, sin, partner_d, q.dtype, HEAD_DIM)
                k_rot, v_new = _cache_new_kv(k_rot, v_new, k_scale, v_scale, KV_FP8, SOFT_ROUND)
                _store_new_kv(k_slot, v_slot, k_rot, v_new, HEAD_DIM)
            tl.debug_barrier()  # the stores above are seen by this program's loads below
    if KV_FP8 and F16_DOT:  # after the new token's k was rotated in q's dtype
        if FP8_QK:
            q, score_scale = _fp8_query(q, qk_scale, SOFT_ROUND)
        else:
            q = _f16_query(q, qk_scale)
            score_scale = qk_scale
        v_tile_scale, v_out_scale = _f16_value_scale(v_scale)
    else:
        v_tile_scale = v_scale
        v_out_scale = v_scale
        score_scale = qk_scale
    loop_end = end
    if PREFETCH:  # attended first (online softmax takes tiles in any order): it holds no registers in the loop
        if end > start:
            acc, l_i, m_i = _attend_kv_tile(acc, l_i, m_i, q, k_last, v_last, valid_last, qk_scale,
                                            DOT_PRECISION, DOT_UPCAST, KV_FP8, v_tile_scale, V_DEQUANT, F16_DOT)
        loop_end = last_tile
    if REG_PREFETCH:  # the tile after loop_end is fully masked: it moves no bytes
        k, v, offs_n, kv_valid = _load_kv_tile(
            k_base, v_base, block_table_row, start, loop_end,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, block_size, BLOCK_N, HEAD_DIM,
            ids, ids_first, IDS_REG, FP8_QK)
        for start_n in range(start, loop_end, BLOCK_N):
            k_next, v_next, offs_next, valid_next = _load_kv_tile(
                k_base, v_base, block_table_row, start_n + BLOCK_N, loop_end,
                stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, block_size, BLOCK_N, HEAD_DIM,
                ids, ids_first, IDS_REG, FP8_QK)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, kv_valid, qk_scale, score_scale, v_tile_scale,
                                         DOT_PRECISION, DOT_UPCAST, KV_FP8, V_DEQUANT, F16_DOT, FP8_QK)
            k, v, offs_n, kv_valid = k_next, v_next, offs_next, valid_next
    else:
        for start_n in range(start, loop_end, BLOCK_N):
            k, v, offs_n, kv_valid = _load_kv_tile(
                k_base, v_base, block_table_row, start_n, end,
                stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, block_size, BLOCK_N, HEAD_DIM,
                ids, ids_first, IDS_REG, FP8_QK)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, kv_valid, qk_scale, score_scale, v_tile_scale,
                                         DOT_PRECISION, DOT_UPCAST, KV_FP8, V_DEQUANT, F16_DOT, FP8_QK)

    # l_i is 0 only for an empty share; NaN in the cache stays NaN in the output
    no_keys = l_i == 0.0
    out = acc / tl.where(no_keys, 1.0, l_i)[:, None]
    if KV_FP8 and (F16_DOT or not V_DEQUANT):
        out = out * v_out_scale
    if DIRECT_OUT:
        tl.store(out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
    else:
        lse = tl.where(no_keys, float("-inf"), m_i + tl.log2(tl.where(no_keys, 1.0, l_i)))
        tl.store(partial_lse_ptr + seq * stride_pl_s + heads * stride_pl_h + split, lse, mask=head_valid)
        if end > start:  # an empty split's output is never read
            tl.store(partial_out_ptr + seq * stride_po_s + heads[:, None] * stride_po_h
                     + split * stride_po_split + offs_d[None, :], out, mask=head_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h, stride_o_s, stride_o_h,
    num_splits, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """out[s, h] = sum_j 2^(lse_j - M) partial_out[s, h, j] / sum_j 2^(lse_j - M),  M = max_j lse_j
    (0 when no split saw a key, e.g. a padded sequence with seq_len 0)."""
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_j = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(partial_lse_ptr + seq * stride_pl_s + head * stride_pl_h + offs_j,
                  mask=offs_j < num_splits, other=float("-inf"))
    nonempty = lse != float("-inf")  # NaN counts as nonempty, so it propagates
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(nonempty, tl.exp2(lse - m), 0.0)  # [SPLITS_PAD]
    o = tl.load(partial_out_ptr + seq * stride_po_s + head * stride_po_h
                + offs_j[:, None] * stride_po_split + offs_d[None, :],
                mask=nonempty[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM]
    den = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + seq * stride_o_s + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty))
