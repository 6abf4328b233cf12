"""Shape rules of the decode attention launch (kernels.decode_attention): how many KV
splits, which tile, and the workspace for the split partials. From shapes only, so a
CUDA graph captured for a batch-size bucket keeps them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from tandem.kernels import switches
from tandem.kernels.device_props import num_sms

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 128  # below this the merge costs more than it saves
PROGRAMS_PER_SM = 3  # splits are added until the grid is about this many waves (tuned on an H200)


@dataclass
class DecodeWorkspace:
    """Partial results of the split phase; allocate once for the largest batch and reuse
    (e.g. one per CUDA graph pool): any num_seqs <= its first dimension fits."""

    partial_out: torch.Tensor  # [max_num_seqs, num_q_heads, max_splits, head_dim] fp32
    partial_lse: torch.Tensor  # [max_num_seqs, num_q_heads, max_splits] fp32

    @classmethod
    def allocate(cls, max_num_seqs: int, num_q_heads: int, head_dim: int,
                 max_splits: int = MAX_SPLITS, device: torch.device | str = "cuda") -> "DecodeWorkspace":
        return cls(
            torch.empty((max_num_seqs, num_q_heads, max_splits, head_dim), dtype=torch.float32, device=device),
            torch.empty((max_num_seqs, num_q_heads, max_splits), dtype=torch.float32, device=device),
        )

    def fits(self, num_seqs: int, num_q_heads: int, num_splits: int, head_dim: int) -> bool:
        n, h, s, d = self.partial_out.shape
        return num_seqs <= n and num_q_heads == h and num_splits <= s and head_dim == d


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Splits per (sequence, KV head), from shapes only: enough programs to fill the GPU,
    no share shorter than MIN_TOKENS_PER_SPLIT of the longest possible context."""
    useful = triton.cdiv(max_context_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(_wanted_splits(num_seqs, num_kv_heads, device), useful, MAX_SPLITS))


def _wanted_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    return triton.cdiv(PROGRAMS_PER_SM * num_sms(device), max(num_seqs * num_kv_heads, 1))


def row_classes(max_rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_fp8: bool,
                device: torch.device) -> list[int]:
    """The fewest row counts in 1..max_rows that meet every way the rules treat rows: the first
    count of each run of counts with the same tile (``_tile_config``) and the same wanted split
    count (``num_kv_splits``); the rest of a launch depends on the context only."""
    firsts, last = [], None
    for rows in range(1, max_rows + 1):
        key = (_tile_config(head_dim, dtype, rows * num_kv_heads, kv_fp8),
               min(_wanted_splits(rows, num_kv_heads, device), MAX_SPLITS))
        if key != last:
            firsts.append(rows)
            last = key
    return firsts




# Wide grids (num_seqs * num_kv_heads programs before splits; 16-bit, head_dim 128): 32-token tiles
# on 3 stages with the block ids in registers (so the loop's loads run ahead), from WIDE_GRID on 4
# warps, from WIDER_GRID on 2. Engine A/B, llama2-7b on an H200, two rounds (docs/kernels.md):
# b64 6.44 -> 6.39 ms per step (4 warps; 2 warps 6.49), b128 9.32 -> 9.11 (2 warps; 4 warps 9.33);
# at b1 and b8 (32 and 256 programs) the 64-token tile with per-tile ids stays (b8 4.34 vs 4.38).
WIDE_GRID = 1024
WIDER_GRID = 4096


# An FP8 cache (head_dim 128, from FP8_MIN_GRID programs): 4 warps, 2 stages, 128-token tiles (twice
# the bf16 tile's tokens, as many bytes), 64-token tiles from FP8_SMALL_TILE_GRID programs, the block
# ids in registers from WIDE_GRID; V is widened with its scale in the tile (V_DEQUANT, every FP8
# cache) and, with a 16-bit q, the products run in fp16 (FP8_F16_DOT: one E4M3 -> f16x2 conversion
# per two codes). One H200, 2026-12-02, ``python3 -m tandem.bench.tune_fp8 --parts attention``
# (llama3-8b, 54 settings at the rule's splits): 64 x 256 tokens 21.7 -> 17.1 us, 8 x 2048 22.8 ->
# 19.9. 2026-12-03 at de2551d, ``--attention-ids --attention-cases`` (48 settings each; fp8 rule
# before -> this rule, bf16 cache): llama2-7b 128 x 384 (4096 programs) 179.1 -> 163.1 us (191.1),
# 64 x 384 99.9 -> 87.0 (106.7); llama3-8b 128 x 256 (1024 programs) 41.4 -> 34.4 (38.8), 64 x 256
# 17.1 -> 15.7 (23.4), 8 x 2048 20.0 -> 18.0 (27.6), 1 x 2048 8.6 -> 8.0 (8.3). The bf16 wide
# rule's 32-token tile on 2 warps was 157.8 us at 4096 MHA programs but 43.7 at 1024 GQA ones.
# Below FP8_MIN_GRID the bf16 rule's tile stays: at batch 1 (8 programs) the 128-token tile made the
# llama3-8b step slower (tandem bench engine --kv-cache-dtype fp8: 4.146 -> 4.373 ms).
FP8_MIN_GRID = 64
FP8_SMALL_TILE_GRID = 512
FP8_F16_DOT = True  # an FP8 cache's products in fp16 (kernels.decode_attention.F16_DOT)
# An FP8 cache's scores from an E4M3 product (kernels.decode_attention.FP8_QK: q quantized per head, no
# K code widened; a tuning form, off until `tandem.bench.tune_fp8 --attention-fp8-scores` and
# `bash scripts/gpu.sh step-ab` time it).
FP8_QK_SCORES = False


def _tile_config(head_dim: int, dtype: torch.dtype, num_programs: int = 0,
                 kv_fp8: bool = False) -> tuple[int, int, int, bool]:
    """(BLOCK_N, num_warps, num_stages, block ids in registers) from shapes only;
    ``num_programs``: num_seqs * num_kv_heads; ``kv_fp8``: the cache holds E4M3 codes."""
    override = switches.current().decode_tile  # TANDEM_DECODE_TILE (tandem.kernels.switches): tuning A/Bs
    if override is not None:
        return (*override, False)
    if kv_fp8 and head_dim == 128 and num_programs >= FP8_MIN_GRID:
        return 64 if num_programs >= FP8_SMALL_TILE_GRID else 128, 4, 2, num_programs >= WIDE_GRID
    if dtype in (torch.bfloat16, torch.float16) and head_dim == 128 and num_programs >= WIDE_GRID:
        return 32, 2 if num_programs >= WIDER_GRID else 4, 3, True
    block_n = 32 if (dtype == torch.float32 and head_dim > 64) or head_dim > 128 else 64
    return block_n, 4, 2, False
