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

Metric definitions (TTFT, ITL, TPOT, E2E, goodput) are in :mod:`bench.serve_metrics`;
SSE parsing in :mod:`bench.sse`; one request in :mod:`bench.serve_request`; the
report and ``--result-json`` rows in :mod:`bench.serve_report`.

Exit status of :func:`main`: 0 when at least one request succeeded, 1 when none
did, 2 on a usage/setup error (bad arguments, model lookup failed), 130 when
interrupted (Ctrl-C prints and saves the partial results first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import httpx

from tandem.bench.datasets import RequestSpec, arrival_offsets, parse_range, synthetic_requests
from tandem.bench.serve_metrics import RequestResult, compute_metrics, parse_goodput, parse_percentiles
from tandem.bench.serve_report import format_report, json_safe, request_row
from tandem.bench.serve_request import ENDPOINT_PATHS, BenchConfig, api_root, fetch_model, send_request
from tandem.bench.serve_shards import run_in_processes, run_loop

__all__ = [
    "BenchConfig", "BenchState", "add_arguments", "build_parser", "compute_metrics",
    "fetch_model", "main", "run_benchmark",
]


@dataclass
class BenchState:
    """Shared with the caller so that results survive an interrupt."""

    results: list[RequestResult] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    interrupted: bool = False
    in_flight: int = 0

    @property
    def duration(self) -> float:
        if self.start is None:
            return 0.0
        end = self.end if self.end is not None else time.perf_counter()
        return max(end - self.start, 0.0)


async def run_benchmark(
    cfg: BenchConfig,
    specs: Sequence[RequestSpec],
    state: BenchState | None = None,
    stop: asyncio.Event | None = None,
    offsets: Sequence[float] | None = None,
    start_at: float | None = None,
) -> BenchState:
    """Send ``specs`` at ``cfg.request_rate`` (gamma arrivals) with at most
    ``cfg.max_concurrency`` in flight. Setting ``stop`` (Ctrl-C does, when this
    runs in the main thread) stops sending, cancels what is in flight and returns
    the partial state with ``interrupted`` set. ``offsets`` (arrival times from the
    start) and ``start_at`` (a ``time.perf_counter()`` value, the same clock in every
    process of the host) let several processes share one schedule."""
    state = state if state is not None else BenchState()
    stop = stop if stop is not None else asyncio.Event()
    if offsets is None:
        offsets = arrival_offsets(len(specs), cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.request_timeout)

    loop = asyncio.get_running_loop()
    sigint_installed = False

    def on_sigint() -> None:
        stop.set()
        # A second Ctrl-C gets Python's default handler (KeyboardInterrupt).
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        sigint_installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        pass  # not the main thread / no signal support: the caller handles it

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def one(spec: RequestSpec, res: RequestResult) -> None:
            if sem is not None:
                await sem.acquire()
            try:
                res.start = time.perf_counter() - (state.start or 0.0)
                state.in_flight += 1
                try:
                    await send_request(client, cfg, spec, res)
                finally:
                    state.in_flight -= 1
            finally:
                if sem is not None:
                    sem.release()

        async def dispatch() -> None:
            tasks: list[asyncio.Task] = []
            try:
                for spec, offset in zip(specs, offsets):
                    delay = state.start + float(offset) - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    res = RequestResult(spec.index, spec.prompt_len, spec.output_len)
                    state.results.append(res)
                    tasks.append(asyncio.create_task(one(spec, res)))
                await asyncio.gather(*tasks)
            finally:
                # Interrupted (possibly while waiting for the next arrival): cancel
                # what is in flight and wait for it, so nothing outlives the client.
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        if start_at is not None:
            await asyncio.sleep(max(start_at - time.perf_counter(), 0.0))
        progress_task = asyncio.create_task(_progress(state, len(specs))) if cfg.progress else None
        state.start = start_at if start_at is not None else time.perf_counter()
        run_task = asyncio.create_task(dispatch())
        stop_task = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if not run_task.done():
                state.interrupted = True
                run_task.cancel()
            state.end = time.perf_counter()
            try:
                await run_task
            except asyncio.CancelledError:
                if not state.interrupted:
                    raise
        finally:
            if state.end is None:
                state.end = time.perf_counter()
            stop_task.cancel()
            if progress_task is not None:
                progress_task.cancel()
            if sigint_installed:
                try:
                    loop.remove_signal_handler(signal.SIGINT)
                except (NotImplementedError, RuntimeError, ValueError):
                    pass
            if progress_task is not None:
                _progress_line(state, len(specs))
                sys.stderr.write("\n")
    return state


def _progress_line(state: BenchState, total: int) -> None:
    done = sum(r.finished for r in state.results)
    ok = sum(r.success for r in state.results)
    sys.stderr.write(
        f"\r  {done}/{total} done ({ok} ok), {state.in_flight} in flight, "
        f"{state.duration:7.1f} s "
    )
    sys.stderr.flush()


async def _progress(state: BenchState, total: int) -> None:
    while True:
        _progress_line(state, total)
        await asyncio.sleep(0.5)

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
