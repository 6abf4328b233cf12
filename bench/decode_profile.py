"""Where a decode step's time goes, per kernel, against the bandwidth floor.

    python3 -m tandem.bench.decode_profile --out $OUT/decode_profile.json [--model llama2-7b] [--batches 1,64]
        [--prefill 2048] [--mixed 1024:7168] [--quantization fp8 --kv-cache-dtype fp8]

For each batch size (context 256 tokens): the whole step read back before the
next is launched (graph replay, sampling, one host sync; the worker's run-ahead
hides the host part), the graph replay alone, and a
profile of one eager forward grouped by kernel (the same kernels the graph
replays), each group's time per step and, for the matmuls, the bandwidth they
reach on their weights; and the step by part (``step_parts``: GEMMs, attention, other
kernels, the gaps between kernels, sampling, host). ``--prefill N`` also profiles one N-token prefill forward
by kernel; ``--mixed D:P`` profiles a colocated worker's mixed step: D decode rows
and one P-token prompt chunk in one forward, replayed as piecewise graphs
(``engine.mixed_graph``, as the colocated worker runs it) and eagerly, each with the host's
part (until the call returns); the kernels are the eager forward's. Every profile also sums its kernels by
kind (GEMMs, attention, the rest) and gives the GEMMs' rate against the matmul rate
measured in the same run (FP8 weights: the FP8 rate; else bf16). Prints a table;
writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from tandem.bench.engine import build_runner, weight_bytes
from tandem.bench.timing import ceilings, median_ms


def kernel_table(fn, steps: int = 5) -> dict[str, float]:
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
    logits = runner.forward(chunks)
    sampling_ms = median_ms(lambda: sample(logits, greedy, [1] * batch), reps=50, warmup=5)
    replay_ms = median_ms(graphs.graph(bucket).replay, reps=50, warmup=5)
    runner.graphs = None
    try:
        eager_ms = median_ms(lambda: runner.forward(chunks), reps=10, warmup=2)
        kernels = kernel_table(lambda: runner.forward(chunks))
    finally:
        runner.graphs = graphs
    return {"step_ms": step_ms, "replay_ms": replay_ms, "sampling_ms": sampling_ms, "eager_ms": eager_ms,
            "kernels_us": kernels, "parts_ms": step_parts(step_ms, replay_ms, sampling_ms, kernels)}


def step_parts(step_ms: float, replay_ms: float, sampling_ms: float, kernels_us: dict[str, float]) -> dict[str, float]:
    """Where one decode step's milliseconds go: the forward's kernels by kind, ``between
    kernels`` (the graph replay's time beyond its kernels' sum: launch boundaries and idle SMs;
    negative where programmatic dependent launch overlaps neighbouring kernels), ``sampling``
    (the logits to token ids on the host, its kernels and read-back included) and ``host`` (the
    rest of the step: the forward's metadata and launch, which the worker's run-ahead overlaps
    with the step before)."""
    by_kind = kinds(kernels_us)
    kernels_ms = sum(by_kind.values()) / 1e3
    parts = {kind: us / 1e3 for kind, us in by_kind.items()}
    parts["between kernels"] = replay_ms - kernels_ms
    parts["sampling"] = sampling_ms
    parts["host"] = step_ms - replay_ms - sampling_ms
    return {k: round(v, 4) for k, v in parts.items()}


GEMM_MARKS = ("gemm", "gemv", "scaled_mm", "cutlass", "nvjet", "xmma", "matmul", "skinny", "sm90_")
ATTENTION_MARKS = ("attention", "attn", "flash", "_decode_partial", "_decode_reduce")  # ours: kernels/decode_attention.py


def kinds(kernels_us: dict[str, float]) -> dict[str, float]:
    """Microseconds per kind: gemm, attention, other (norms, rotary, quantization, copies, sampling)."""
    out = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for name, us in kernels_us.items():
        low = name.lower()
        kind = ("attention" if any(m in low for m in ATTENTION_MARKS)
                else "gemm" if any(m in low for m in GEMM_MARKS) else "other")
        out[kind] += us
    return out


def gemm_flops(config, num_tokens: int, num_logits: int) -> float:
    """FLOPs of a forward's GEMMs: every projection over ``num_tokens`` rows, the LM head over
    ``num_logits`` rows."""
    qkv = config.hidden_size * (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
    o = config.num_q_heads * config.head_dim * config.hidden_size
    mlp = 3 * config.hidden_size * config.intermediate_size
    return 2.0 * (num_tokens * config.num_layers * (qkv + o + mlp) + num_logits * config.hidden_size * config.vocab_size)


def gemm_summary(r: dict, config, num_tokens: int, num_logits: int, matmul_tflops: float) -> dict:
    by_kind = kinds(r["kernels_us"])
    tflops = gemm_flops(config, num_tokens, num_logits) / (by_kind["gemm"] / 1e6) / 1e12 if by_kind["gemm"] else 0.0
    return {"kinds_us": by_kind, "gemm_TFLOPs": tflops, "gemm_fraction_of_matmul_rate": tflops / matmul_tflops}


def profile_mixed(runner, num_decode: int, prompt_len: int, context: int = 256) -> dict:
    """A mixed step: ``num_decode`` one-token decode rows (context ``context``) then one
    ``prompt_len``-token prompt chunk, in one eager forward (as the colocated worker runs it)."""
    from tandem.engine.attention import SeqChunk

    blocks_per_seq = -(-(context + 8) // runner.block_size)
    chunks = [SeqChunk([11 + i], context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
              for i in range(num_decode)]
    first = num_decode * blocks_per_seq
    chunks.append(SeqChunk(list(range(3, prompt_len + 3)), 0,
                           list(range(first, first + -(-prompt_len // runner.block_size)))))
    graphs, runner.graphs = runner.graphs, None
    mixed_graphs = runner.mixed_graphs
    result = {}
    try:
        if mixed_graphs is not None and mixed_graphs.can_run(chunks):  # as the colocated worker runs it
            result["graph_ms"] = median_ms(lambda: runner.forward(chunks), reps=10, warmup=2)
            result["graph_host_ms"] = host_ms(lambda: runner.forward(chunks))
        runner.mixed_graphs = None
        result["ms"] = median_ms(lambda: runner.forward(chunks), reps=10, warmup=2)
        result["host_ms"] = host_ms(lambda: runner.forward(chunks))
        result["kernels_us"] = kernel_table(lambda: runner.forward(chunks), steps=3)
    finally:
        runner.graphs, runner.mixed_graphs = graphs, mixed_graphs
    return result


def host_ms(fn, reps: int = 5) -> float:
    """Median milliseconds until ``fn`` returns, the device idle at the call: the host's part of
    a step (launches, metadata) when nothing waits for the device."""
    import statistics
    import time

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def profile_prefill(runner, prompt_len: int) -> dict:
    from tandem.engine.attention import SeqChunk

    blocks = list(range(-(-prompt_len // runner.block_size)))
    chunk = [SeqChunk(list(range(3, prompt_len + 3)), 0, blocks)]
    ms = median_ms(lambda: runner.forward(chunk), reps=5, warmup=2)
    return {"ms": ms, "kernels_us": kernel_table(lambda: runner.forward(chunk), steps=3)}


def _print_kernels(kernels_us: dict[str, float], top: int = 16, summary: dict | None = None) -> None:
    total = sum(kernels_us.values())
    if summary is not None:
        k = summary["kinds_us"]
        print(f"  by kind: gemm {k['gemm']:.1f} us ({100 * k['gemm'] / total:.1f}%), attention "
              f"{k['attention']:.1f} us ({100 * k['attention'] / total:.1f}%), other {k['other']:.1f} us; "
              f"GEMMs at {summary['gemm_TFLOPs']:.0f} TFLOP/s = "
              f"{100 * summary['gemm_fraction_of_matmul_rate']:.0f}% of the matmul rate")
    for name, us in list(kernels_us.items())[:top]:
        print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prefill", type=int, default=0, help="also profile one prefill of this many tokens")
    parser.add_argument("--mixed", default="", help="also profile mixed steps D:P[,D:P...]: D decode rows + a "
                                                    "P-token prompt chunk")
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--out", default="decode_profile.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    mixed = [tuple(int(v) for v in m.split(":")) for m in args.mixed.split(",") if m]
    ceil = ceilings()
    if args.quantization == "fp8":
        from tandem.bench.timing import fp8_matmul_TFLOPs

        ceil["fp8_matmul_TFLOPs"] = fp8_matmul_TFLOPs()
    matmul_tflops = ceil["fp8_matmul_TFLOPs" if args.quantization == "fp8" else "bf16_matmul_TFLOPs"]
    need = max([max(batches) * 288, args.prefill] + [d * 288 + p for d, p in mixed]) + 1024
    runner = build_runner(args.model, num_tokens=need, max_seq_len=1024, max_batch_size=max(batches),
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if mixed:  # the colocated worker's graphs for steps with prompt chunks
        runner.enable_mixed_graphs(max(d + p for d, p in mixed))
    config = runner.config
    floor_ms = weight_bytes(runner) / (ceil["hbm_copy_TBps"] * 1e12) * 1e3
    result = {"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "ceilings": ceil, "weight_floor_ms": floor_ms, "batches": {}, "mixed": {}}
    for batch in batches:
        r = profile_batch(runner, batch)
        r["summary"] = gemm_summary(r, config, batch, batch, matmul_tflops)
        result["batches"][batch] = r
        total = sum(r["kernels_us"].values())
        print(f"\n== {args.model} batch {batch}: step {r['step_ms']:.3f} ms, replay {r['replay_ms']:.3f} ms, "
              f"eager {r['eager_ms']:.3f} ms, kernels {total / 1e3:.3f} ms, weight floor {floor_ms:.3f} ms")
        _print_kernels(r["kernels_us"], summary=r["summary"])
        print("  step by part (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in r["parts_ms"].items()))
    for num_decode, prompt_len in mixed:
        r = profile_mixed(runner, num_decode, prompt_len)
        r["summary"] = gemm_summary(r, config, num_decode + prompt_len, num_decode + 1, matmul_tflops)
        result["mixed"][f"{num_decode}:{prompt_len}"] = r
        print(f"\n== {args.model} mixed step, {num_decode} decode rows + a {prompt_len}-token chunk: "
              f"graphs {r.get('graph_ms', 0):.3f} ms (host {r.get('graph_host_ms', 0):.3f} ms), eager {r['ms']:.3f} ms "
              f"(host {r['host_ms']:.3f} ms), kernels {sum(r['kernels_us'].values()) / 1e3:.3f} ms")
        _print_kernels(r["kernels_us"], summary=r["summary"])
    if args.prefill:
        r = result["prefill"] = profile_prefill(runner, args.prefill)
        r["summary"] = gemm_summary(r, config, args.prefill, 1, matmul_tflops)
        print(f"\n== {args.model} prefill {args.prefill}: {r['ms']:.3f} ms, "
              f"kernels {sum(r['kernels_us'].values()) / 1e3:.3f} ms")
        _print_kernels(r["kernels_us"], top=20, summary=r["summary"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
