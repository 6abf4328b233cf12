"""``tandem bench serve``: a streaming load client for an OpenAI-compatible server.

In the manner of ``vllm bench serve``, torch-free (httpx async + numpy). It sends
synthetic random prompts to ``/v1/completions`` (token-id prompts, so the prompt
length is exact) or ``/v1/chat/completions`` (random words), always streaming with
``ignore_eos`` and ``stream_options.include_usage``, at a Poisson/Gamma request
rate and/or under a concurrency cap, and reports throughput, TTFT / TPOT / ITL /
E2E latency statistics and goodput under SLOs.

Usage::

    tandem bench serve --base-url http://127.0.0.1:8000 --endpoint completions \\
        --num-prompts 200 --input-len 512 --output-len 128 \\
        --request-rate 8 --max-concurrency 32 --goodput ttft:200 tpot:50 \\
        --result-json out/bench.json

    python -m tandem.bench.serve ...          # same, without the ``tandem`` entry point

Metric definitions (TTFT, ITL, TPOT, E2E, goodput) are in :mod:`tandem.bench.serve_metrics`;
SSE parsing in :mod:`tandem.bench.sse`; one request in :mod:`tandem.bench.serve_request`; the
report and ``--result-json`` rows in :mod:`tandem.bench.serve_report`.

Exit status of :func:`main`: 0 when at least one request succeeded, 1 when none
did, 2 on a usage/setup error (bad arguments, model lookup failed), 130 when
interrupted (Ctrl-C prints and saves the partial results first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time

import httpx

from tandem.bench.datasets import parse_range, synthetic_requests
from tandem.bench.serve_metrics import compute_metrics, parse_goodput, parse_percentiles
from tandem.bench.serve_report import format_report, json_safe, request_row
from tandem.bench.serve_request import ENDPOINT_PATHS, BenchConfig, api_root, fetch_model
from tandem.bench.serve_run import BenchState, run_benchmark
from tandem.bench.serve_shards import run_in_processes, run_loop

__all__ = [
    "BenchConfig", "BenchState", "add_arguments", "build_parser", "compute_metrics",
    "fetch_model", "main", "run_benchmark",
]


# --------------------------------------------------------------------------- CLI


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench serve`` (also ``python -m tandem.bench.serve``)."""
    g = parser.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, e.g. http://host:port (a trailing /v1 is fine)")
    g.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions",
                   help="completions -> /v1/completions (token-id prompts), "
                        "chat -> /v1/chat/completions (random-word prompts)")
    g.add_argument("--model", default=None,
                   help="model name to send (default: first id from GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME",
                   help="LoRA adapter names the server serves: the requests take them in turn "
                        "(request i asks for NAME i mod n), as vLLM's bench serve spreads load over adapters")

    g = parser.add_argument_group("load shape")
    g.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send")
    g.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="mean requests/s with gamma-distributed gaps; inf (default) "
                        "sends all at once")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, "
                        ">1 more regular")
    g.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="at most this many requests in flight")
    g.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds allowed for one whole request (default 600)")
    g.add_argument("--num-processes", type=_positive_int, default=1,
                   help="client processes sharing the schedule, for servers that stream more chunks "
                        "than one Python process reads (--max-concurrency is split between them; "
                        "Ctrl-C discards the results)")

    g = parser.add_argument_group("synthetic prompts")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--input-len", type=_positive_int, default=1024,
                   help="prompt tokens per request (default 1024)")
    x.add_argument("--input-len-range", type=_range, default=None, metavar="A:B",
                   help="prompt tokens uniform in [A, B]")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--output-len", type=_positive_int, default=128,
                   help="max_tokens per request, sent with ignore_eos (default 128)")
    x.add_argument("--output-len-range", type=_range, default=None, metavar="A:B",
                   help="max_tokens uniform in [A, B]")
    g.add_argument("--min-token-id", type=int, default=10,
                   help="smallest random prompt token id (completions; default 10)")
    g.add_argument("--max-token-id", type=int, default=499,
                   help="largest random prompt token id (completions; default 499: inside every vocabulary, "
                        "the demo model's 500 ids included)")
    g.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths and arrivals")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body")

    g = parser.add_argument_group("report")
    g.add_argument("--percentiles", default="50,90,99",
                   help="comma-separated percentiles to report (default 50,90,99)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000 (ms)")
    g.add_argument("--result-json", default=None, metavar="PATH",
                   help="write all metrics, the config and per-request rows here")
    g.add_argument("--save-text", action="store_true",
                   help="keep the generated text in the per-request rows")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stderr is a terminal)")


def _config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, list[float], dict[str, float]]:
    extra: dict = {}
    if args.extra_body:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    if not 0 <= args.min_token_id <= args.max_token_id:
        raise ValueError("need 0 <= --min-token-id <= --max-token-id")
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    cfg = BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model or "",
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        request_timeout=args.request_timeout,
        temperature=args.temperature,
        api_key=args.api_key,
        extra_body=extra,
        seed=args.seed,
        keep_text=args.save_text,
        lora_modules=tuple(args.lora_modules),
        progress=progress,
    )
    return cfg, parse_percentiles(args.percentiles), parse_goodput(args.goodput)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; print the report, write
    ``--result-json``; return the exit status (see the module docstring)."""
    try:
        cfg, percentiles, slos = _config_from_args(args)
        specs = synthetic_requests(
            args.num_prompts,
            chat=cfg.chat,
            input_len=args.input_len,
            input_len_range=args.input_len_range,
            output_len=args.output_len,
            output_len_range=args.output_len_range,
            min_token_id=args.min_token_id,
            max_token_id=args.max_token_id,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 2

    if not cfg.model:
        try:
            cfg.model = asyncio.run(
                fetch_model(cfg.base_url, cfg.api_key, timeout=min(30.0, cfg.request_timeout))
            )
        except (httpx.HTTPError, RuntimeError, ValueError, OSError) as exc:
            print(f"bench serve: cannot get the model from {api_root(cfg.base_url)}/v1/models "
                  f"({type(exc).__name__}: {exc}); pass --model", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130

    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    print(f"bench serve: {len(specs)} requests to {cfg.url} (model {cfg.model}), "
          f"request rate {rate}/s, burstiness {cfg.burstiness:g}, "
          f"max concurrency {cfg.max_concurrency or 'none'}", flush=True)

    state = BenchState()
    try:
        if args.num_processes > 1:
            state = run_in_processes(cfg, specs, args.num_processes)
        else:
            run_loop(run_benchmark(cfg, specs, state))
    except KeyboardInterrupt:
        # No signal handler could be installed (or a second Ctrl-C): report what we have.
        state.interrupted = True
        if state.end is None and state.start is not None:
            state.end = time.perf_counter()
    if state.interrupted:
        print("\nbench serve: interrupted; partial results:", file=sys.stderr)

    metrics = compute_metrics(state.results, state.duration, percentiles, slos)
    metrics["interrupted"] = state.interrupted
    print(format_report(metrics, cfg, metrics["peak_concurrency"]), flush=True)

    if args.result_json:
        config = {k: v for k, v in vars(args).items() if not callable(v)}
        config.update(model=cfg.model, url=cfg.url)
        config.pop("api_key", None)
        doc = {
            "config": config,
            "metrics": metrics,
            "requests": [request_row(r, slos) for r in state.results],
        }
        try:
            with open(args.result_json, "w") as f:
                json.dump(json_safe(doc), f, indent=1, default=str)
                f.write("\n")
        except OSError as exc:
            print(f"bench serve: cannot write {args.result_json}: {exc}", file=sys.stderr)
            return 2
        print(f"bench serve: results written to {args.result_json}")

    if state.interrupted:
        return 130
    return 0 if metrics["completed"] > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.bench.serve",
        description="Streaming load benchmark for an OpenAI-compatible server.",
    )
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
