"""When a decode step waits for the requests in prefill to join its batch.

Where the decode worker shares its GPU with a prefill worker, the two
processes' kernels do not run at once: the GPU gives them turns. A decode step
taken during a prefill forward delays that forward (and the first token of
every request in it) by about its own length, while it advances only the few
requests already decoding; the same step a little later carries the requests
now in prefill too, for about the same cost (a decode step reads all the
weights whatever its batch). So while the batch would grow by at least
``min_growth`` of itself from requests already in prefill, the step is held,
for at most ``max_wait_s`` at a time: a running stream's gap between tokens
grows by at most that much, and the prefill runs alone on the GPU meanwhile.
Only prefills dispatched in the last JOIN_HORIZON_S and not aborted count as
joining: one stuck until its transfer timeout must not slow the batch for long.

With a GPU of its own (nccl between GPUs), or on the CPU, where the processes
run on different cores, a held step would only delay: the worker does not
hold (``shared`` is False).
"""

from __future__ import annotations

MIN_GROWTH = 0.25  # hold while the requests in prefill would grow the batch by >= this fraction
JOIN_HORIZON_S = 2.0  # a prefill dispatched longer ago than this (stuck, or deep in a queue) is not waited for


class BatchWait:
    def __init__(self, max_wait_s: float, max_batch_size: int, min_growth: float = MIN_GROWTH):
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self.max_batch_size = max_batch_size
        self.min_growth = min_growth
        self.shared = False  # the GPU is shared with a prefill worker (the worker keeps this current)
        self._since: float | None = None  # when the current hold began
        self.num_holds = 0  # holds begun since the start (monotonic; for stats)

    def hold(self, num_running: int, num_prefilling: int, now: float) -> bool:
        """True: skip the step this turn. ``num_prefilling``: requests whose prefill is under way."""
        joining = min(num_prefilling, self.max_batch_size - num_running)
        if not self.shared or self.max_wait_s == 0 or num_running == 0 or joining < self.min_growth * num_running:
            self._since = None
            return False
        if self._since is None:
            self._since = now
            self.num_holds += 1
        if now - self._since >= self.max_wait_s:
            self._since = None  # this step goes; the next one may be held again
            return False
        return True

    @staticmethod
    def num_joining(prefilling, now: float) -> int:
        """Requests in prefill that may join soon: dispatched within JOIN_HORIZON_S and not aborted
        (an aborted one only waits for its PrefillDone; a handoff stuck until its timeout is not
        worth a slowed batch)."""
        return sum(1 for r in prefilling if not r.abort_requested and r.dispatched_at is not None
                   and now - r.dispatched_at < JOIN_HORIZON_S)

    @property
    def holding(self) -> bool:
        return self._since is not None


def shares_gpu(device: str, prefill_workers) -> bool:
    """Whether one of ``prefill_workers`` computes on the GPU ``device``
    (``tandem.engine.runner_factory.device_identity`` strings: GPU UUIDs, unique across hosts, so
    containers sharing a GPU under different host names match too)."""
    return device.startswith("cuda") and any(w.device == device for w in prefill_workers)
