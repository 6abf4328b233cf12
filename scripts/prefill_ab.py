"""Prefill 2048 on the engine, the prefill attention's old rule (tiles-first grid, 128x128 tiles,
8 warps) against the new one (heavy-first, GQA/head-dim tiles), alternated on one GPU.
    python3 scripts/prefill_ab.py   (device: source scripts/device_env.sh first)"""
import torch

import kernels.prefill_attention as pa
from bench.engine import build_runner, prefill_workload
from engine.block_allocator import BlockAllocator

new_rule = pa._tile_config


def old_rule(num_tokens, num_seqs, head_dim, group, dtype):
    block_m, block_n, num_warps, num_stages = new_rule(num_tokens, num_seqs, head_dim, group, dtype)
    return (128, 128, 8, 2) if block_m == 128 else (block_m, block_n, num_warps, num_stages)


for name in ("llama2-7b", "llama3-8b", "llama3.2-1b"):
    runner = build_runner(name, num_tokens=4096, max_seq_len=1024, max_batch_size=1)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    times = {"old": [], "new": []}
    for _ in range(3):
        for label in ("old", "new"):
            pa.HEAVY_FIRST, pa._tile_config = (False, old_rule) if label == "old" else (True, new_rule)
            times[label].append(prefill_workload(runner, allocator)["ms"])
    print(name, {k: [round(t, 2) for t in v] for k, v in times.items()}, flush=True)
    del runner
    torch.cuda.empty_cache()
