"""Prefill 2048 through the engine: the chunk's keys read from the QKV output (chunk_kv, the
rule) against every key read through the block table (the fifth session's kernel path, but
with the same tile rule), alternated on one GPU.
    python3 scripts/prefill_chunk_ab.py [--models llama2-7b] [--rounds 3]   (device: source scripts/device_env.sh)"""
import argparse

import torch

import tandem.kernels.prefill_attention as pa
from tandem.bench.engine import build_runner, prefill_workload
from tandem.engine.block_allocator import BlockAllocator

parser = argparse.ArgumentParser()
parser.add_argument("--models", default="llama2-7b,llama3-8b,llama3.2-1b")
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
launch = pa._launch_prefill_attention


def paged(*args):  # prefill_attention passes chunk_kv as the tenth argument: dropped
    return launch(*args[:9])


for name in args.models.split(","):
    runner = build_runner(name, num_tokens=4096, max_seq_len=4096, max_batch_size=1)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    times = {"chunk": [], "paged": []}
    for _ in range(args.rounds):
        for label in times:
            pa._launch_prefill_attention = launch if label == "chunk" else paged
            times[label].append(prefill_workload(runner, allocator)["ms"])
    pa._launch_prefill_attention = launch
    print(name, "prefill 2048 ms:", {k: [round(t, 2) for t in v] for k, v in times.items()}, flush=True)
    del runner, allocator
    torch.cuda.empty_cache()
