"""The skinny GEMM's tiles (``kernels.skinny_gemm``): which tile, stages and K split each shape
takes, from the shapes and the device's SMs only, and the measurements behind each rule."""

from __future__ import annotations

import triton

_SMEM_BYTES = 220 << 10  # tile buffers per program (sm90 allows 227 KB)


def fp8_tile_config(M: int, N: int, K: int, silu_mul: bool, sms: int = 132) -> tuple[int, int, int, int, int]:
    """The tiles of the FP8 tensor-core form (E4M3 x and W). One H200, 2026-12-02,
    ``python3 -m tandem.bench.tune_fp8 --parts skinny`` (llama3-8b at 16 and 64 rows, 24 settings;
    docs/kernels.md): 64 weight rows a program on 4 warps throughout; 256-wide K tiles (256
    bytes a row, the bf16 rule's) on up to 5 stages for the plain projections, best or within 4%
    of it on qkv, o and down (the bf16-tuned rule: 5-20% slower); gate/up with SiLU·mul on
    128-wide tiles, 3 stages, unsplit (64 rows: 40.2 us against the bf16 rule's 56.3). K split
    while the grid stays within one program per SM (qkv's 96 programs: unsplit; o's and
    down's 64: two splits, as the sweep's best)."""
    block_m = max(16, triton.next_power_of_2(M))
    block_k = 128 if silu_mul else 256
    block_k = min(block_k, max(32, triton.next_power_of_2(K)))
    stage_bytes = ((2 if silu_mul else 1) * 64 + block_m) * block_k
    num_stages = 3 if silu_mul else max(2, min(5, _SMEM_BYTES // stage_bytes - 1))
    programs, k_tiles = triton.cdiv(N // 2 if silu_mul else N, 64), triton.cdiv(K, block_k)
    split_k = 1
    while (not silu_mul and split_k < 8 and programs * (split_k + 1) <= sms
           and k_tiles >= (split_k + 1) * num_stages):
        split_k += 1
    return 64, block_k, 4, num_stages, split_k


def tile_config(M: int, N: int, K: int, silu_mul: bool, elem_size: int = 2,
                sms: int = 132, fp8_mma: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, split_k) for x [M, K] and a weight of N rows
    (2I for silu_mul) from shapes and the device's SMs (``sms``, 132: an H200's) only. Measured
    on one H200 (torch 2.11, triton 3.6), 2026-11-30, at ea8f9db with
    ``python3 -m tandem.bench.tune_skinny_gemm --quick`` (llama2-7b, 64 rows; docs/kernels.md):
    best or within 2% of the best of 22 settings for the down projection (27.4-28.0 us against
    cuBLAS's 30.9) and the o projection; on qkv and gate_up at 64 rows 64-wide K tiles were
    better (and only tied cuBLAS), where kernels.ops sends them to cuBLAS; at 8 and 32 rows the
    engine A/B ran this rule (faster than cuBLAS on three models).

    64 rows (one wgmma tile of 4 warps) by 128-wide K tiles (256 contiguous bytes per bf16 row),
    64-wide where fewer than 3 stages would fit; as many stages, up to 4, as fit in shared memory:
    a stage holds the weight tile(s) and the x tile, and the peeled first tile keeps one more set
    allocated through the loop (seen in the sm90 TTGIR of Triton 3.9); K split until the grid has
    ~one program per SM, splits of >= num_stages tiles on average (the launcher evens them out,
    so the last may hold fewer).

    gate/up with SiLU·mul at 33-64 rows takes 128-row weight tiles (gate and up: 256 rows a
    program), 64-wide K, 8 warps, 4 stages: the best of the sweep at llama2-7b 64 rows (one H200,
    2026-11-30, at 3197fbc, ``python3 -m tandem.bench.tune_skinny_gemm --quick``: 51.1 us against
    cuBLAS 51.4 plus 1.9 for its SiLU·mul kernel; this rule's 64-row tile took 59.5), and 0.05 ms
    off the whole 7B b64 step in the engine A/B (2026-11-30, at ecd6a75, ``scripts/decode_ab.py
    --models llama2-7b --batches 64 --rounds 2 --variants rule,gate_up64_w``, removed since:
    6.507/6.512 -> 6.455/6.458 ms; docs/kernels.md). 200 KB of shared memory leaves one program
    per SM, so K is split only while the grid stays one wave (7B's 86 and 8B's 112 programs:
    unsplit, as measured; 1B's 64: in two).

    ``fp8_mma`` (E4M3 x and W on FP8 tensor cores): ``fp8_tile_config``.
    """
    block_n, block_m = 64, max(16, triton.next_power_of_2(M))
    if fp8_mma:
        return fp8_tile_config(M, N, K, silu_mul, sms)
    if silu_mul and block_m == 64 and (2 * 128 + 64) * 64 * elem_size * 5 <= _SMEM_BYTES:
        # gate/up at 33-64 rows (bf16; fp32 does not fit): see the docstring's last paragraph
        programs, k_tiles = triton.cdiv(N // 2, 128), triton.cdiv(K, 64)
        split_k = 1  # one program per SM (200 KB of shared memory): split only while one wave holds them
        while split_k < 8 and programs * (split_k + 1) <= sms and k_tiles >= (split_k + 1) * 4:
            split_k += 1
        return 128, 64, 8, 4, split_k
    for block_k in (min(128, max(16, triton.next_power_of_2(K))), 64):
        stage_bytes = ((2 if silu_mul else 1) * block_n + block_m) * block_k * elem_size
        num_stages = max(2, min(4, _SMEM_BYTES // stage_bytes - 1))
        if num_stages >= 3 or block_k <= 64:  # 2 stages leave no tile in flight during the wait
            break
    programs = triton.cdiv(N // 2 if silu_mul else N, block_n)
    k_tiles = triton.cdiv(K, block_k)
    split_k = 1
    while split_k < 8 and programs * split_k < 0.9 * sms and k_tiles >= (split_k + 1) * num_stages:
        split_k += 1
    return block_n, block_k, 4, num_stages, split_k
