"""``tandem bench throughput``: the offline shape, against a running cluster.

N requests of fixed (or sampled) lengths sent at once, no concurrency cap, as
``trtllm-bench throughput`` and ``vllm bench throughput`` measure: what the server
makes of a whole batch. The load client is ``tandem bench serve``'s (streaming, token-id
prompts of exact length, ``ignore_eos``); its defaults here are TensorRT-LLM's published
shape (3,072 requests of 128 in / 128 out) and four client processes (one Python client
cannot read the chunks of thousands of streams as fast as they come). Besides the serve
report it prints how many requests were refused (HTTP 429): an offline batch is served
whole unless an operator bounded the queue (``--max-queue-len``, ``--queue-timeout-s``).

    tandem bench throughput --base-url http://127.0.0.1:8000 --num-prompts 3072 \\
        --input-len 128 --output-len 128 --result-json out/throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from tandem.bench import serve as bench_serve

DEFAULTS = dict(num_prompts=3072, input_len=128, output_len=128, num_processes=4, request_rate=float("inf"),
                max_concurrency=None, progress=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_serve.add_arguments(parser)
    parser.set_defaults(**DEFAULTS)


def refused(metrics: dict) -> int:
    """Requests the server refused with 429 (the serve client's error texts start with the status)."""
    return sum(e["count"] for e in metrics.get("errors", []) if str(e["error"]).startswith("HTTP 429"))


def main(args: argparse.Namespace) -> int:
    keep = args.result_json is not None
    if not keep:  # the refusals are read back from the serve client's result file
        fd, args.result_json = tempfile.mkstemp(prefix="tandem-throughput-", suffix=".json")
        os.close(fd)
    try:
        status = bench_serve.main(args)
        try:
            with open(args.result_json) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return status
        doc["metrics"]["refused"] = refused(doc["metrics"])
        if keep:
            with open(args.result_json, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
        print(f"bench throughput: {doc['metrics']['refused']} of {args.num_prompts} requests refused (429)")
        return status
    finally:
        if not keep:
            os.unlink(args.result_json)
