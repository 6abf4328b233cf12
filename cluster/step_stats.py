"""Periodic worker-loop statistics, logged the way operators read them from vLLM:
steps and tokens per second, mean batch, where a loop iteration's time went, and
the queues and free KV blocks at the end of the interval, and how much each of the
worker's counters (``counters``: e.g. the device allocator's) rose during it.

Where each second of the loop went: the worker times the parts of its loop turn
(``phase``: scheduling, launching a step, reading one back, its messages) and how long it
waited for the device (``add_time``); each line carries every part's share of the interval's
wall time as ``<part>_frac``. A device-bound worker spends its seconds in ``device_wait``; one
whose host work is the limit spends them in the other parts while the device idles."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import structlog

log = structlog.get_logger(__name__)


class StepStats:
    def __init__(self, role: str, interval_s: float, counters: Callable[[], dict[str, int]] | None = None):
        """``interval_s``: how often to log (--stats-interval-s); ``counters``: cumulative counts,
        read when a line is logged, whose rise over the interval the line carries."""
        self.role = role
        self.interval_s = interval_s
        self._counters = counters
        self._last_counts = counters() if counters is not None else {}
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._since = now
        self.steps = self.tokens = 0
        self.forward_s = self.loop_s = 0.0
        self.parts_s: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        """Time the block as part ``name`` of the loop (added up over the interval)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(name, time.perf_counter() - start)

    def add_time(self, name: str, seconds: float) -> None:
        self.parts_s[name] = self.parts_s.get(name, 0.0) + seconds

    def record(self, num_tokens: int, forward_s: float, loop_s: float) -> None:
        self.steps += 1
        self.tokens += num_tokens
        self.forward_s += forward_s
        self.loop_s += loop_s

    def maybe_log(self, **gauges) -> bool:
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return False
        rises = {}
        if self._counters is not None:
            counts = self._counters()
            rises = {name: value - self._last_counts.get(name, 0) for name, value in counts.items()}
            self._last_counts = counts
        parts = {f"{name}_frac": round(seconds / elapsed, 3) for name, seconds in self.parts_s.items()}
        if self.steps:
            log.info(
                f"{self.role} stats",
                steps_per_s=round(self.steps / elapsed, 1),
                tokens_per_s=round(self.tokens / elapsed, 1),
                mean_batch=round(self.tokens / self.steps, 1),
                forward_ms=round(1e3 * self.forward_s / self.steps, 3),
                loop_ms=round(1e3 * self.loop_s / self.steps, 3),
                busy_fraction=round(self.loop_s / elapsed, 3),
                **parts,
                **gauges,
                **rises,
            )
        self._reset(now)
        return True
