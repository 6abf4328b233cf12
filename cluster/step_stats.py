"""Periodic worker-loop statistics, logged the way operators read them from vLLM:
steps and tokens per second, mean batch, where a loop iteration's time went, and
the queues and free KV blocks at the end of the interval, and how much each of the
worker's counters (``counters``: e.g. the device allocator's) rose during it."""

from __future__ import annotations

import time
from collections.abc import Callable

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
        if self.steps:
            log.info(
                f"{self.role} stats",
                steps_per_s=round(self.steps / elapsed, 1),
                tokens_per_s=round(self.tokens / elapsed, 1),
                mean_batch=round(self.tokens / self.steps, 1),
                forward_ms=round(1e3 * self.forward_s / self.steps, 3),
                loop_ms=round(1e3 * self.loop_s / self.steps, 3),
                busy_fraction=round(self.loop_s / elapsed, 3),
                **gauges,
                **rises,
            )
        self._reset(now)
        return True
