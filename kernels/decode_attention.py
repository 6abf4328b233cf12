"""Paged decode attention: split-KV (flash-decoding) with GQA grouping.

Phase 1, grid (num_kv_heads, num_seqs, num_splits): one program takes all
GROUP query heads that share one KV head, so each key/value is read once per
group, and attends them to an equal share of the sequence's visible keys
(its last sliding_window keys, or all of them). It writes a partial result
per split: the normalized output and log2-sum-exp. Phase 2, grid (num_seqs,
num_q_heads), merges the splits. With one split, phase 1 writes the output
directly and phase 2 is skipped. The KV head is the grid's fastest axis, so
the programs running at one time read the heads of the same tokens: the
cache's [block, slot, head, dim] layout puts them side by side in memory.

CUDA-graph safe: the number of splits comes from shapes only (batch size,
heads, block_tables.shape[1] * block_size), each sequence's share is computed
in the kernel from its seq_len, nothing reads device values on the host, and
the partial buffers are either passed in (DecodeWorkspace) or taken from the
caching allocator (which is capture-safe). The shape rules (splits, tiles) and the
workspace live in kernels.decode_config.

An FP8 cache (kernels.fp8_kv) is read as E4M3 codes widened to q's dtype in registers; the
program's KV head scales multiply its scores (K, folded into the softmax scale) and its
output (V), and the fused form writes the new token's codes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels.decode_config import FP8_F16_DOT, DecodeWorkspace, _tile_config, num_kv_splits, row_classes
from tandem.kernels.decode_tiles import (_attend_kv_tile, _cache_new_kv, _f16_query, _f16_value_scale,
                                         _load_kv_tile, _rotated_new_kv, _store_new_kv)
from tandem.kernels.dot import upcast_bf16_dot
from tandem.kernels.fp8_kv import is_fp8, soft_round
from tandem.kernels.paged_checks import check_paged_attention
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options

LOG2E = 1.4426950408889634
HEADS_FIRST = True  # grid order: KV heads fastest (bench.tune_decode_attention compares both)
# Fused form only: the share's last tile is loaded before the PDL wait, the new token's k and v
# taken from registers instead of a store, barrier and reload; for batches of up to
# PREFETCH_MAX_BATCH (engine A/B on an H200, docs/kernels.md: batch 1 llama3.2-1b 0.947 ->
# 0.916 ms per step, llama3-8b 4.12 -> 4.06; batch 8 llama2-7b 4.56 -> 4.76, slower).
PREFETCH = True
PREFETCH_MAX_BATCH = 1
# Two launch choices an A/B passes to the launcher (``_launch_decode_attention``'s keywords), the
# rule otherwise: ``max_registers``, a cap on the split phase's registers per thread (ptxas
# .maxnreg; the rule: the compiler's choice). Programs per SM are what this kernel's bandwidth
# rides on (docs/kernels.md): at 4 warps an SM holds 4 programs above 102 registers, 5 at 96 or
# fewer (38 KB of shared memory each stops it at 5); CUDA launches only. ``ids_in_registers``: the
# block ids of a program's share loaded once into registers (at most IDS_REG_MAX of them), each
# tile's taken from there (tl.gather) instead of a load that its K/V loads wait for (the rule:
# kernels.decode_config._tile_config's).
IDS_REG_MAX = 512
# An FP8 cache's products in fp16 (F16_DOT: one conversion per two codes, the score scale folded
# into q; a 16-bit q only): None follows the rule (kernels.decode_config.FP8_F16_DOT), True / False
# force it (tests, A/Bs).
F16_DOT: bool | None = None


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
    F16_DOT: tl.constexpr = False,
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
    """
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
        q = _f16_query(q, qk_scale)
        v_tile_scale, v_out_scale = _f16_value_scale(v_scale)
    else:
        v_tile_scale = v_scale
        v_out_scale = v_scale
    loop_end = end
    if PREFETCH:  # attended first (online softmax takes tiles in any order): it holds no registers in the loop
        if end > start:
            acc, l_i, m_i = _attend_kv_tile(acc, l_i, m_i, q, k_last, v_last, valid_last, qk_scale,
                                            DOT_PRECISION, DOT_UPCAST, KV_FP8, v_tile_scale, V_DEQUANT, F16_DOT)
        loop_end = last_tile
    for start_n in range(start, loop_end, BLOCK_N):
        k, v, offs_n, kv_valid = _load_kv_tile(
            k_base, v_base, block_table_row, start_n, end,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, block_size, BLOCK_N, HEAD_DIM,
            ids, ids_first, IDS_REG)
        acc, l_i, m_i = _attend_kv_tile(acc, l_i, m_i, q, k, v, kv_valid, qk_scale, DOT_PRECISION, DOT_UPCAST,
                                        KV_FP8, v_tile_scale, V_DEQUANT, F16_DOT)

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


class NewToken(NamedTuple):
    """The decode token's own K/V, unrotated, for the fused form (``decode_attention_new_token``)."""

    k: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    positions: torch.Tensor  # [num_seqs] int64 (= seq_len - 1)
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] fp32
    slot_mapping: torch.Tensor  # [num_seqs] int64, -1 = do not write


class LaunchPlan(NamedTuple):
    """What the shape rules (or a tuning ``config``) pick for one launch."""

    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    heads_first: bool
    v_dequant: bool
    f16_dot: bool
    ids_reg: int  # block table entries loaded once into registers (0: per tile)

    def variant(self, head_dim: int) -> tuple:
        """What of the plan is compiled into the kernels' binaries (the splits only as one or
        several, and through the merge's padded count and warps); launches with equal variants and
        equal argument specializations run the same binaries."""
        return (self.block_n, self.num_warps, self.num_stages, self.num_splits == 1,
                triton.next_power_of_2(self.num_splits), _reduce_warps(head_dim, self.num_splits),
                self.heads_first, self.v_dequant, self.f16_dot, self.ids_reg)


def _reduce_warps(head_dim: int, num_splits: int) -> int:
    return 4 if head_dim * num_splits >= 2048 else 2


def launch_plan(num_seqs: int, table_width: int, q_dtype: torch.dtype, k_cache: torch.Tensor,
                sliding_window: int | None = None, config: tuple | None = None,
                ids_in_registers: bool | None = None) -> LaunchPlan:
    """The launch of ``num_seqs`` rows whose block tables are ``table_width`` entries wide
    (``_launch_decode_attention``'s keywords otherwise), from shapes only."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    max_context_len = table_width * block_size
    if sliding_window is not None:
        max_context_len = min(max_context_len, sliding_window)
    num_splits = num_kv_splits(num_seqs, num_kv_heads, max_context_len, k_cache.device)
    block_n, num_warps, num_stages, rule_ids = _tile_config(head_dim, q_dtype, num_seqs * num_kv_heads,
                                                            is_fp8(k_cache))
    if ids_in_registers is None:
        ids_in_registers = rule_ids
    heads_first, v_dequant = HEADS_FIRST, True  # V_DEQUANT: every FP8 cache (kernels.decode_config)
    f16_dot = FP8_F16_DOT if F16_DOT is None else F16_DOT
    if config is not None:
        block_n, num_warps, num_stages, num_splits, *rest = config
        heads_first = rest[0] if rest else heads_first
        v_dequant = bool(len(rest) > 1 and rest[1])  # explicit: False unless given
        f16_dot = bool(len(rest) > 2 and rest[2]) if F16_DOT is None else F16_DOT
    ids_reg = 0
    if ids_in_registers:  # the share's block table entries, rounded up to a power of 2
        share = triton.cdiv(triton.cdiv(max_context_len, num_splits), block_n) * block_n
        ids_reg = triton.next_power_of_2(triton.cdiv(share, block_size) + 1)
        if ids_reg > IDS_REG_MAX:  # too many to hold: per-tile loads, on the tile made for them
            ids_reg = 0
            if config is None:
                block_n, num_warps, num_stages, _ = _tile_config(head_dim, q_dtype)
    return LaunchPlan(block_n, num_warps, num_stages, num_splits, heads_first, v_dequant, f16_dot, ids_reg)


def decode_attention_variants(max_rows: int, max_width: int, q_dtype: torch.dtype, k_cache: torch.Tensor,
                              sliding_window: int | None = None) -> dict[tuple, tuple[int, int]]:
    """Every variant (``LaunchPlan.variant``) that decode rows launch with 1..``max_rows`` rows and
    block tables 1..``max_width`` entries wide -> the first (rows, width) that launches it: a
    warm-up that runs one launch of each compiles all of them."""
    head_dim = k_cache.shape[3]
    variants: dict[tuple, tuple[int, int]] = {}
    for rows in row_classes(max_rows, k_cache.shape[2], head_dim, q_dtype, is_fp8(k_cache), k_cache.device):
        for width in range(1, max_width + 1):
            variants.setdefault(launch_plan(rows, width, q_dtype, k_cache, sliding_window).variant(head_dim),
                                (rows, width))
    return variants


def _launch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, scale, sliding_window, workspace,
                             config: tuple | None = None, new_token: NewToken | None = None,
                             k_scale=None, v_scale=None, ids_in_registers: bool | None = None,
                             max_registers: int | None = None):
    """``config``: (BLOCK_N, num_warps, num_stages, num_splits[, heads_first[, v_dequant[, f16_dot]]])
    instead of the shape rules (tuning only; v_dequant: an FP8 cache's V widened with its scale,
    V_DEQUANT; f16_dot: an FP8 cache's products in fp16, F16_DOT, for a 16-bit q).
    ``new_token``: rotary and the KV write fused in.
    ``k_scale``, ``v_scale``: an FP8 cache's [num_kv_heads] fp32 scales of this layer.
    ``ids_in_registers``, ``max_registers``: an A/B's choices instead of the rule (above)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    k_scale, v_scale = check_paged_attention(q, k_cache, v_cache, block_tables, out, sliding_window, k_scale, v_scale)
    assert seq_lens.shape == (num_seqs,) and block_tables.shape[0] == num_seqs
    if new_token is not None:
        k_new, v_new, positions, cos_sin, slots = new_token
        assert k_new.shape == v_new.shape == (num_seqs, num_kv_heads, head_dim)
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1 and cos_sin.stride(1) == 1
        assert positions.shape == slots.shape == (num_seqs,) and cos_sin.shape[1] == head_dim
        assert k_new.dtype == v_new.dtype == q.dtype
        new_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos_sin.stride(0))
    else:
        k_new = v_new = positions = cos_sin = slots = q  # unused
        new_strides = (0, 0, 0, 0, 0)
    if num_seqs == 0:
        return
    group = num_q_heads // num_kv_heads
    plan = launch_plan(num_seqs, block_tables.shape[1], q.dtype, k_cache, sliding_window, config,
                       ids_in_registers)
    block_n, num_warps, num_stages, num_splits, heads_first, v_dequant, f16_dot, ids_reg = plan
    direct = num_splits == 1
    if direct:
        partial_out = partial_lse = out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(num_seqs, num_q_heads, head_dim, num_splits, q.device)
        assert workspace.fits(num_seqs, num_q_heads, num_splits, head_dim), "decode workspace too small"
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
        assert partial_out.stride(3) == 1 and partial_lse.stride(2) == 1
        assert partial_out.device == q.device and partial_out.dtype == partial_lse.dtype == torch.float32
        po_strides = partial_out.stride()[:3]
        pl_strides = partial_lse.stride()[:2]
    grid = (num_kv_heads, num_seqs, num_splits) if heads_first else (num_seqs, num_kv_heads, num_splits)
    _decode_partial_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, partial_out, partial_lse, out,
        k_new, v_new, positions, cos_sin, slots, k_scale, v_scale,
        q.stride(0), q.stride(1), block_tables.stride(0), *new_strides,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *po_strides, *pl_strides, out.stride(0), out.stride(1),
        scale * LOG2E, sliding_window or 0, block_size, num_splits, block_tables.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, HEAD_DIM=head_dim, HAS_WINDOW=sliding_window is not None,
        DIRECT_OUT=direct, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=upcast_bf16_dot(q.dtype), HEADS_FIRST=heads_first, NEW_TOKEN=new_token is not None,
        PREFETCH=PREFETCH and new_token is not None and num_seqs <= PREFETCH_MAX_BATCH, IDS_REG=ids_reg,
        KV_FP8=is_fp8(k_cache), SOFT_ROUND=soft_round(), V_DEQUANT=v_dequant and is_fp8(k_cache),
        F16_DOT=f16_dot and is_fp8(k_cache) and q.dtype in (torch.bfloat16, torch.float16),
        num_warps=num_warps, num_stages=num_stages, **launch_options(q),
        **({"maxnreg": max_registers} if max_registers is not None and q.is_cuda else {}),
    )
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            partial_out, partial_lse, out, *po_strides, *pl_strides, out.stride(0), out.stride(1),
            num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            num_warps=_reduce_warps(head_dim, num_splits), **launch_options(q),
        )


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, k_scale=None,
                     v_scale=None, *, workspace: DecodeWorkspace | None = None):
    """ops.decode_attention in Triton; ``workspace`` (keyword only, not in the op) holds the split
    partials, allocated per call from the caching allocator without one."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_seqs, num_q_heads, head_dim]
    _launch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, float(scale),
                             sliding_window, workspace, k_scale=k_scale, v_scale=v_scale)
    return out


def decode_attention_new_token(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                               seq_lens, scale, sliding_window=None, k_scale=None, v_scale=None):
    """ops.decode_attention_new_token in one Triton launch (rotary and the KV write fused in)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_seqs, num_q_heads, head_dim]
    _launch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, float(scale), sliding_window, None,
                             new_token=NewToken(k, v, positions, cos_sin_cache, slot_mapping),
                             k_scale=k_scale, v_scale=v_scale)
    return out
