"""The three capacity policies on one mixed workload with a constrained KV pool (CPU, tiny model).

    python -m tandem.bench.capacity_policies --out /tmp/policies.json

For each policy: ``tandem serve`` (private redis-server, one prefill and one
decode worker, the gateway) with ``--max-tokens-in-paged-kv-cache`` far below
what the load needs, then ``tandem.bench.serve``'s client sends every request at once
(prompts and outputs of mixed lengths, ``ignore_eos``, greedy) and the pauses
are read from the gateway's ``tandem_preemptions_total``. The policies take
turns ``--repeat`` times (a shared machine's load then hits them alike); the
table gives, per policy, the median of each number over its runs and the best
output tok/s (the run least disturbed by whatever else the machine ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx

from tandem.bench.datasets import synthetic_requests
from tandem.bench.serve import BenchConfig, compute_metrics, fetch_model, run_benchmark
from tandem.cluster.policies import CAPACITY_POLICY_NAMES
from tandem.import_guard import python_argv
from tandem.launcher import free_port, wait_healthy

POLICIES = CAPACITY_POLICY_NAMES


def serve_argv(args: argparse.Namespace, policy: str, port: int) -> list[str]:
    return [*python_argv("-m", "tandem"), "serve", "--model", args.model, "--port", str(port),
            "--device", "cpu", "--capacity-scheduler-policy", policy,
            "--max-tokens-in-paged-kv-cache", str(args.pool_tokens), "--tokens-per-block", "16",
            "--max-seq-len", str(args.max_seq_len), "--max-input-len", str(args.max_input_len),
            "--max-num-tokens", str(args.max_num_tokens), "--max-batch-size", str(args.max_batch_size),
            "--queue-timeout-s", "600", "--log-level", "warning"]


def preemptions(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^tandem_preemptions_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    # one thread per process: prefill, decode and gateway share the cores, and OpenMP threads spinning
    # against each other made runs up to 10x slower on a 2-core VM
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cluster = subprocess.Popen(serve_argv(args, policy, port), stdout=subprocess.DEVNULL, start_new_session=True,
                               env=env)
    try:
        if not wait_healthy(base_url + "/health", [cluster], 300):
            raise RuntimeError(f"the cluster did not start under {policy}")
        specs = synthetic_requests(args.num_prompts, chat=False, input_len_range=tuple(args.input_len_range),
                                   output_len_range=tuple(args.output_len_range), min_token_id=3,
                                   max_token_id=400, seed=args.seed)
        cfg = BenchConfig(base_url=base_url, model=asyncio.run(fetch_model(base_url)), request_rate=args.request_rate,
                          seed=args.seed)
        state = asyncio.run(run_benchmark(cfg, specs))
        metrics = compute_metrics(state.results, state.duration, percentiles=(50.0, 99.0))
        time.sleep(1.0)  # one heartbeat: the worker's last count reaches the registry
        metrics["num_preemptions"] = preemptions(base_url)
        return metrics
    finally:
        cluster.send_signal(signal.SIGTERM)
        try:
            cluster.wait(30)
        except subprocess.TimeoutExpired:
            cluster.kill()


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| policy | completed | out tok/s median (best) | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | pauses |",
             "|---|---|---|---|---|---|---|"]
    for policy, runs in results.items():
        def median(get):
            return statistics.median(get(m) for m in runs)

        tok_s = [m["output_throughput"] for m in runs]
        lines.append(
            f"| {policy} | {median(lambda m: m['completed']):.0f}/{runs[0]['num_requests']} | "
            f"{statistics.median(tok_s):.0f} ({max(tok_s):.0f}) | "
            f"{median(lambda m: m['ttft_ms']['p50']):.0f} | {median(lambda m: m['ttft_ms']['p99']):.0f} | "
            f"{median(lambda m: m['e2el_ms']['p50']):.0f} | {median(lambda m: m['num_preemptions']):.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(16, 160))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(16, 160))
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--pool-tokens", type=int, default=1024, help="decode (and prefill) KV pool, in tokens")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=512)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5, help="runs per policy, taking turns")
    parser.add_argument("--out", help="write every policy's metrics here (JSON)")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    for round_ in range(args.repeat):
        for policy in args.policies:
            print(f"-- {policy} (run {round_ + 1}/{args.repeat})", file=sys.stderr, flush=True)
            results[policy].append(run_policy(args, policy))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
