"""Where a decode step's time goes, per kernel, against the bandwidth floor.

    python3 -m tandem.bench.decode_profile --out $OUT/decode_profile.json [--model llama2-7b] [--batches 1,64]
        [--prefill 2048]

For each batch size (context 256 tokens): the whole step read back before the
next is launched (graph replay, sampling, one host sync; the worker's run-ahead
hides the host part), the graph replay alone, and a
profile of one eager forward grouped by kernel (the same kernels the graph
replays), each group's time per step and, for the matmuls, the bandwidth they
reach on their weights. ``--prefill N`` also profiles one N-token prefill forward
by kernel. Prints a table; writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch

from tandem.bench.engine import build_runner, weight_bytes
from tandem.bench.timing import ceilings, median_ms


def _kernel_table(fn, steps: int = 5) -> dict[str, float]:
    """Kernel name -> device microseconds per call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    table: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            table[event.name[:90]] += event.device_time / steps
    return dict(sorted(table.items(), key=lambda kv: -kv[1]))


def profile_batch(runner, batch: int, context: int = 256) -> dict:
    from tandem.cluster.sampling import SamplingParams
    from tandem.engine.attention import SeqChunk
    from tandem.engine.sampler import sample

    blocks_per_seq = -(-(context + 8) // runner.block_size)
    chunks = [SeqChunk([11 + i], context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
              for i in range(batch)]
    greedy = [SamplingParams(temperature=0.0)] * batch
    step_ms = median_ms(lambda: sample(runner.forward(chunks), greedy, [1] * batch), reps=50, warmup=5)
    graphs = runner.graphs
    bucket = next(b for b in graphs.buckets if b >= batch)
    runner.forward(chunks)
    replay_ms = median_ms(graphs._graphs[bucket].replay, reps=50, warmup=5)
    runner.graphs = None
    try:
        eager_ms = median_ms(lambda: runner.forward(chunks), reps=10, warmup=2)
        kernels = _kernel_table(lambda: runner.forward(chunks))
    finally:
        runner.graphs = graphs
    return {"step_ms": step_ms, "replay_ms": replay_ms, "eager_ms": eager_ms, "kernels_us": kernels}


def profile_prefill(runner, prompt_len: int) -> dict:
    from tandem.engine.attention import SeqChunk

    blocks = list(range(-(-prompt_len // runner.block_size)))
    chunk = [SeqChunk(list(range(3, prompt_len + 3)), 0, blocks)]
    ms = median_ms(lambda: runner.forward(chunk), reps=5, warmup=2)
    return {"ms": ms, "kernels_us": _kernel_table(lambda: runner.forward(chunk), steps=3)}


def _print_kernels(kernels_us: dict[str, float], top: int = 16) -> None:
    total = sum(kernels_us.values())
    for name, us in list(kernels_us.items())[:top]:
        print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prefill", type=int, default=0, help="also profile one prefill of this many tokens")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_profile.json"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ceil = ceilings()
    runner = build_runner(args.model, num_tokens=max(max(batches) * 288, args.prefill) + 1024, max_seq_len=1024,
                          max_batch_size=max(batches))
    floor_ms = weight_bytes(runner) / (ceil["hbm_copy_TBps"] * 1e12) * 1e3
    result = {"model": args.model, "ceilings": ceil, "weight_floor_ms": floor_ms, "batches": {}}
    for batch in batches:
        r = profile_batch(runner, batch)
        result["batches"][batch] = r
        total = sum(r["kernels_us"].values())
        print(f"\n== {args.model} batch {batch}: step {r['step_ms']:.3f} ms, replay {r['replay_ms']:.3f} ms, "
              f"eager {r['eager_ms']:.3f} ms, kernels {total / 1e3:.3f} ms, weight floor {floor_ms:.3f} ms")
        _print_kernels(r["kernels_us"])
    if args.prefill:
        r = result["prefill"] = profile_prefill(runner, args.prefill)
        print(f"\n== {args.model} prefill {args.prefill}: {r['ms']:.3f} ms, "
              f"kernels {sum(r['kernels_us'].values()) / 1e3:.3f} ms")
        _print_kernels(r["kernels_us"], top=20)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
