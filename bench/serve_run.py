"""One benchmark run: the request schedule sent from one event loop, and its shared state.

``run_benchmark`` is what ``tandem bench serve`` runs in each client process
(``tandem.bench.serve_shards`` deals one schedule over several of them).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import httpx

from tandem.bench.datasets import RequestSpec, arrival_offsets
from tandem.bench.serve_metrics import RequestResult
from tandem.bench.serve_request import BenchConfig, send_request


@dataclass
class BenchState:
    """Shared with the caller so that results survive an interrupt."""

    results: list[RequestResult] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    interrupted: bool = False
    in_flight: int = 0
    # when the last byte of any response arrived (time.perf_counter()): the server's work is done
    # then; the client still decodes each stream's events after it ends (send_request), which is
    # the client's time, not the server's
    last_received: float | None = None

    @property
    def finished_at(self) -> float:
        """The run's end: the last response's last byte, or (interrupted, or nothing received)
        the moment the run stopped."""
        if self.last_received is not None and not self.interrupted:
            return self.last_received
        return self.end if self.end is not None else time.perf_counter()

    @property
    def duration(self) -> float:
        if self.start is None:
            return 0.0
        return max(self.finished_at - self.start, 0.0)


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
                if res.received is not None:
                    received = (state.start or 0.0) + res.start + res.received
                    state.last_received = max(state.last_received or received, received)
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
