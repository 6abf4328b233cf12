"""``tandem bench serve``'s client processes: the event loop each runs, and
``--num-processes N``: one schedule over several client processes.

One Python process reading SSE falls behind a server that streams ~10k chunks/s
and then measures its own lag. Here the requests (with their arrival times) are
dealt round-robin to N processes; each gets ready, the parent hands all of them
the same start time on the host's monotonic clock (``time.perf_counter``), each
runs ``tandem.bench.serve_run.run_benchmark`` on its share, and the parent merges the
results as if one client had sent them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import queue
import signal
import time
from typing import Sequence

from tandem.bench.datasets import RequestSpec, arrival_offsets
from tandem.bench.serve_request import BenchConfig
from tandem.bench.serve_run import BenchState, run_benchmark

START_MARGIN_S = 0.05  # from "all ready" to the common start
READY_TIMEOUT_S = 120.0


def run_loop(coro):
    """A client process's event loop: uvloop where installed (less overhead per chunk)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_in_processes(cfg: BenchConfig, specs: Sequence[RequestSpec], num_processes: int):
    """Run the benchmark over ``num_processes`` client processes; returns a merged ``BenchState``."""

    offsets = arrival_offsets(len(specs), cfg.request_rate, cfg.burstiness, cfg.seed)
    num_processes = max(1, min(num_processes, len(specs), cfg.max_concurrency or len(specs)))
    # the concurrency split exactly (shard i gets one more while i < the remainder): the sum is the cap
    share, extra = divmod(cfg.max_concurrency, num_processes) if cfg.max_concurrency else (0, 0)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    pipes, procs = [], []
    try:
        for i in range(num_processes):
            parent_end, child_end = ctx.Pipe()
            shard_cfg = dataclasses.replace(cfg, progress=False, max_concurrency=(
                share + (i < extra) if cfg.max_concurrency else None))
            proc = ctx.Process(target=_shard_main, daemon=True,
                               args=(shard_cfg, list(specs[i::num_processes]), list(offsets[i::num_processes]),
                                     child_end, results))
            proc.start()
            pipes.append(parent_end)
            procs.append(proc)
        for pipe in pipes:  # every process is ready (imports done, client built)
            if not pipe.poll(READY_TIMEOUT_S):
                raise RuntimeError("a client process did not get ready")
            pipe.recv()
        start_at = time.perf_counter() + START_MARGIN_S
        for pipe in pipes:
            pipe.send(start_at)
        shards = []
        while len(shards) < len(procs):
            try:
                shards.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a client process failed (exit code {failed[0]})") from None
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(5)
    state = BenchState(start=start_at, end=max(s["end"] for s in shards))  # each shard's finished_at
    state.results = sorted((r for s in shards for r in s["results"]), key=lambda r: r.index)
    return state


def _shard_main(cfg: BenchConfig, specs: list[RequestSpec], offsets: list[float], pipe, results) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt does

    pipe.send("ready")
    start_at = pipe.recv()
    state = BenchState()
    run_loop(run_benchmark(cfg, specs, state, offsets=offsets, start_at=start_at))
    results.put({"results": state.results, "end": state.finished_at})
