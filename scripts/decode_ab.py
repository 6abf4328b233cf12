"""Decode step time through the engine (CUDA graphs, run-ahead, contexts 128-384 as in
bench.engine) for variants of module settings, alternated on one GPU: the rule; decode attention
without PREFETCH or with it at every fused batch (up to 8), at 3 stages; the decode-batch
projections through cuBLAS instead of the skinny GEMM, or the skinny GEMM for every projection
up to 64 rows (kernels.ops.SKINNY_GEMM_*; up to 32, the rule since 3e46018, was the variant
skinny32; at 128 rows it lost everywhere, 7B 9.61 -> 10.53 ms); the o/down projections without
the add-norm finish (unfused) or with it up to 32 rows only.
    python3 scripts/decode_ab.py [--models llama2-7b] [--batches 1,64] [--rounds 2] [--variants rule,cublas]
(device: source scripts/device_env.sh first)"""
import argparse
import gc

import torch

import tandem.kernels.decode_attention as da
import tandem.kernels.decode_config as dc
import tandem.kernels.ops as ops
import tandem.kernels.skinny_gemm as sg
from tandem.bench.engine import build_runner, decode_workload
from tandem.engine.block_allocator import BlockAllocator

VARIANTS = {  # (module, name) -> value, read when the graphs are captured. Lost in the engine A/B
    # (code removed): partly-filled tile first, 32-token tiles, the register-pipelined loop (this
    # script at 2dc0936 and cfc08a0); block ids a tile ahead (IDS_AHEAD, at 1b9d36e); the stream-K
    # skinny GEMM (streamk*, at 5c97901); the skinny GEMM's L2 bulk prefetch (l2, all64_l2, at
    # a82129f); 64-wide K tiles for qkv/gate_up at 64 rows (all64) and the partial last decode tile
    # merged with the one before (merge), both at f113132; half the decode attention programs'
    # tiles in reverse order (stagger, stagger_rev, at 9713b49)
    "rule": {},
    # the rule before the wide-grid tiles (eleventh session): 64-token tiles, per-tile block ids
    "old": {(da, "IDS_IN_REGISTERS"): False, (dc, "_TILE_OVERRIDE"): (64, 4, 2)},
    "no_prefetch": {(da, "PREFETCH"): False},
    "prefetch_b8": {(da, "PREFETCH_MAX_BATCH"): 8},
    "s3": {(dc, "_TILE_OVERRIDE"): (64, 4, 3)},  # the decode attention's stage count alone
    "cublas": {(ops, "SKINNY_GEMM_MAX_ROWS"): 0, (ops, "SKINNY_GEMM_LONG_K_MAX_ROWS"): 0,
               (ops, "SKINNY_SILU_MUL_MAX_ROWS"): 0, (ops, "FUSED_NORM_MAX_ROWS"): 0},
    "skinny64": {(ops, "SKINNY_GEMM_MAX_ROWS"): 64, (ops, "SKINNY_SILU_MUL_MAX_ROWS"): 64},
    "unfused": {(ops, "FUSED_NORM_MAX_ROWS"): 0},  # o/down then their own add + RMSNorm kernel
    "fused32": {(ops, "FUSED_NORM_MAX_ROWS"): 32},  # at 64 rows: o on cuBLAS, down skinny, norms apart
}


def _gate_up_tile(tile):
    """tile_config with ``tile`` for the SiLU·mul (gate/up) GEMM above 32 rows."""
    rule = sg.tile_config

    def tile_config(M, N, K, silu_mul, *args, **kwargs):
        return tile if silu_mul and M > 32 else rule(M, N, K, silu_mul, *args, **kwargs)
    return tile_config


VARIANTS |= {  # ninth session: gate/up + SiLU·mul through the skinny GEMM at 64 rows with the two
    # best tiles of bench.tune_skinny_gemm --quick (eighth session, call 8: 51.1 and 52.9 us against
    # cuBLAS 51.4 + the SiLU·mul kernel; the rule's tile 59.5)
    "gate_up64_w": {(ops, "SKINNY_SILU_MUL_MAX_ROWS"): 64, (sg, "tile_config"): _gate_up_tile((128, 64, 8, 4, 1))},
    "gate_up64_n": {(ops, "SKINNY_SILU_MUL_MAX_ROWS"): 64, (sg, "tile_config"): _gate_up_tile((64, 64, 4, 3, 1))},
    # decode attention with its registers capped: 5 programs per SM instead of 4 where the compiler
    # takes more than 102 (scripts/kernel_resources.py prints what it takes on the device)
    "reg96": {(da, "MAX_REGISTERS"): 96},
    "reg80": {(da, "MAX_REGISTERS"): 80},
    # the share's block ids in registers (no load between a tile's index and its K/V loads: the
    # loop's loads run ahead; a local sm90 compile pipelines 32/3 and 16/4, not 64/2)
    "ids": {(da, "IDS_IN_REGISTERS"): True},
    "ids64s3": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (64, 4, 3)},
    "ids32s3": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (32, 4, 3)},
    "ids32s4": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (32, 4, 4)},
    "ids16s4": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (16, 4, 4)},
    "ids32s3w2": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (32, 2, 3)},
    "ids32s4w2": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (32, 2, 4)},
    # with rotary and the KV write fused into the attention kernel at every batch up to 128
    "ids32s3_f": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (32, 4, 3),
                  (ops, "FUSED_ROTARY_MAX_BATCH"): 128},
    "ids32s3w2_f": {(da, "IDS_IN_REGISTERS"): True, (dc, "_TILE_OVERRIDE"): (32, 2, 3),
                    (ops, "FUSED_ROTARY_MAX_BATCH"): 128},
}
DEFAULTS = {key: getattr(*key) for settings in VARIANTS.values() for key in settings}

parser = argparse.ArgumentParser()
parser.add_argument("--models", default="llama2-7b")
parser.add_argument("--batches", default="1,64")
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--variants", default=",".join(VARIANTS), help="a comma list of: " + ", ".join(VARIANTS))
args = parser.parse_args()
unknown = set(args.variants.split(",")) - set(VARIANTS)
if unknown:
    parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
VARIANTS = {name: VARIANTS[name] for name in args.variants.split(",")}
batches = [int(b) for b in args.batches.split(",")]
for name in args.models.split(","):
    times = {(v, b): [] for v in VARIANTS for b in batches}
    for _ in range(args.rounds):
        for variant, settings in VARIANTS.items():
            for (module, attr), value in {**DEFAULTS, **settings}.items():
                setattr(module, attr, value)
            runner = build_runner(name, num_tokens=max(batches) * 400 + 1024, max_seq_len=4096,
                                  max_batch_size=max(batches))
            allocator = BlockAllocator(runner.num_blocks, runner.block_size)
            for batch in batches:
                times[(variant, batch)].append(decode_workload(runner, allocator, batch)["ms_per_step"])
            del runner, allocator
            gc.collect()
            torch.cuda.empty_cache()
    for (variant, batch), ms in times.items():
        print(f"{name} b{batch} {variant:14s} " + " ".join(f"{t:.3f}" for t in ms) + " ms/step", flush=True)
