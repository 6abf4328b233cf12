"""Decode step time through the engine (CUDA graphs, run-ahead, contexts 128-384 as in
bench.engine) for decode attention variants, alternated on one GPU: the rule (the fused form's
last tile loaded before the PDL wait, kernels.decode_attention.PREFETCH, at batches of up to
PREFETCH_MAX_BATCH); PREFETCH off; PREFETCH at every fused batch (up to 8); the block ids
loaded a tile ahead (IDS_AHEAD) with 3 and with 4 stages, and 3 stages without it.
    python3 scripts/decode_ab.py [--models llama2-7b] [--batches 1,64] [--rounds 2] [--variants rule,ids_ahead_s3]
(device: source scripts/device_env.sh first)"""
import argparse
import gc

import torch

import kernels.decode_attention as da
import kernels.decode_config as dc
from bench.engine import build_runner, decode_workload
from engine.block_allocator import BlockAllocator

VARIANTS = {  # module settings, read when the graphs are captured (the variants that lost in the
    # sixth session, partly-filled tile first, 32-token tiles, the register-pipelined loop: this
    # script at 2dc0936 and cfc08a0)
    "rule": {},
    "no_prefetch": {"PREFETCH": False},
    "prefetch_b8": {"PREFETCH_MAX_BATCH": 8},
    "s3": {"_TILE_OVERRIDE": (64, 4, 3)},  # kernels.decode_config; the stage count alone, as a control
    "ids_ahead_s3": {"IDS_AHEAD": True, "_TILE_OVERRIDE": (64, 4, 3)},
    "ids_ahead_s4": {"IDS_AHEAD": True, "_TILE_OVERRIDE": (64, 4, 4)},
}
DEFAULTS = {name: getattr(dc if name == "_TILE_OVERRIDE" else da, name)
            for name in ("PREFETCH", "PREFETCH_MAX_BATCH", "IDS_AHEAD", "_TILE_OVERRIDE")}

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
            for attr, value in {**DEFAULTS, **settings}.items():
                setattr(dc if attr == "_TILE_OVERRIDE" else da, attr, value)
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
