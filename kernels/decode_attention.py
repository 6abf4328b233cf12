"""Paged decode attention: the launch of its kernels (``kernels.decode_kernels``: split-KV,
flash-decoding, with GQA grouping; a second kernel merges the splits) and the ops that make it.

CUDA-graph safe: the number of splits comes from shapes only (batch size,
heads, block_tables.shape[1] * block_size), each sequence's share is computed
in the kernel from its seq_len, nothing reads device values on the host, and
the partial buffers are either passed in (DecodeWorkspace) or taken from the
caching allocator (which is capture-safe). The shape rules (splits, tiles) and the
workspace live in kernels.decode_config; ``launch_plan`` applies them (or a tuning config) to
one launch, and ``decode_attention_variants`` lists every compiled form a range of shapes takes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from tandem.kernels.decode_config import (FP8_F16_DOT, FP8_QK_SCORES, DecodeWorkspace, _tile_config, num_kv_splits,
                                          row_classes)
from tandem.kernels.decode_kernels import _decode_partial_kernel, _decode_reduce_kernel
from tandem.kernels.dot import upcast_bf16_dot
from tandem.kernels.fp8_kv import is_fp8, soft_round
from tandem.kernels.paged_checks import check_paged_attention
from tandem.kernels import switches
from tandem.kernels.pdl import launch_options

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
# An FP8 cache's scores from an E4M3 product (FP8_QK: each head's q as E4M3 codes under its own
# scale, K's codes unwidened; P.V as F16_DOT's, a 16-bit q only): None follows the rule
# (kernels.decode_config.FP8_QK_SCORES, or TANDEM_FP8_QK_SCORES where set), True / False force it (tests).
FP8_QK: bool | None = None


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
    fp8_qk: bool = False  # an FP8 cache's scores from an E4M3 product (FP8_QK)

    def variant(self, head_dim: int) -> tuple:
        """What of the plan is compiled into the kernels' binaries (the splits only as one or
        several, and through the merge's padded count and warps); launches with equal variants and
        equal argument specializations run the same binaries."""
        return (self.block_n, self.num_warps, self.num_stages, self.num_splits == 1,
                triton.next_power_of_2(self.num_splits), _reduce_warps(head_dim, self.num_splits),
                self.heads_first, self.v_dequant, self.f16_dot, self.ids_reg, self.fp8_qk)


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
    rule_qk = switches.current().fp8_qk_scores  # TANDEM_FP8_QK_SCORES: an A/B of the served step
    fp8_qk = (FP8_QK_SCORES if rule_qk is None else rule_qk) if FP8_QK is None else FP8_QK
    if config is not None:
        block_n, num_warps, num_stages, num_splits, *rest = config
        heads_first = rest[0] if rest else heads_first
        v_dequant = bool(len(rest) > 1 and rest[1])  # explicit: False unless given
        f16_dot = bool(len(rest) > 2 and rest[2]) if F16_DOT is None else F16_DOT
        fp8_qk = bool(len(rest) > 3 and rest[3]) if FP8_QK is None else FP8_QK
    # FP8_QK takes F16_DOT's V: an FP8 cache and a 16-bit q
    fp8_qk = fp8_qk and is_fp8(k_cache) and q_dtype in (torch.bfloat16, torch.float16)
    f16_dot = f16_dot or fp8_qk
    ids_reg = 0
    if ids_in_registers:  # the share's block table entries, rounded up to a power of 2
        share = triton.cdiv(triton.cdiv(max_context_len, num_splits), block_n) * block_n
        ids_reg = triton.next_power_of_2(triton.cdiv(share, block_size) + 1)
        if ids_reg > IDS_REG_MAX:  # too many to hold: per-tile loads, on the tile made for them
            ids_reg = 0
            if config is None:
                block_n, num_warps, num_stages, _ = _tile_config(head_dim, q_dtype)
    return LaunchPlan(block_n, num_warps, num_stages, num_splits, heads_first, v_dequant, f16_dot, ids_reg, fp8_qk)


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
                             max_registers: int | None = None, reg_prefetch: bool = False):
    """``config``: (BLOCK_N, num_warps, num_stages, num_splits[, heads_first[, v_dequant[, f16_dot[,
    fp8_qk]]]]) instead of the shape rules (tuning only; v_dequant: an FP8 cache's V widened with its
    scale, V_DEQUANT; f16_dot: an FP8 cache's products in fp16, F16_DOT, for a 16-bit q; fp8_qk: its
    scores from an E4M3 product, FP8_QK, with F16_DOT's P.V).
    ``new_token``: rotary and the KV write fused in.
    ``k_scale``, ``v_scale``: an FP8 cache's [num_kv_heads] fp32 scales of this layer.
    ``ids_in_registers``, ``max_registers``: an A/B's choices instead of the rule (above);
    ``reg_prefetch``: the loop's next tile loaded into registers before a tile's math
    (``decode_kernels``' REG_PREFETCH; not the rule's, not with the fused form's PREFETCH)."""
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
    block_n, num_warps, num_stages, num_splits, heads_first, v_dequant, f16_dot, ids_reg, fp8_qk = plan
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
    prefetch = PREFETCH and new_token is not None and num_seqs <= PREFETCH_MAX_BATCH and not fp8_qk
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
        PREFETCH=prefetch, REG_PREFETCH=reg_prefetch and not prefetch, IDS_REG=ids_reg,
        KV_FP8=is_fp8(k_cache), SOFT_ROUND=soft_round(), V_DEQUANT=v_dequant and is_fp8(k_cache),
        F16_DOT=f16_dot and is_fp8(k_cache) and q.dtype in (torch.bfloat16, torch.float16), FP8_QK=fp8_qk,
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
