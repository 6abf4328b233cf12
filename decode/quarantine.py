"""Destination blocks a prefill worker taken for lost may still write into.

The shm and cuda_ipc transports write the decode pool directly: revoking a handoff's grant
cannot stop a write (the nccl transport's receiving side can, and needs none of this). A prefill
worker whose heartbeat lapsed may only be frozen (a stop signal, a long stall) and finish the
chunk it was computing when it wakes, into blocks the decode worker would by then have given to
another request. So when the decode worker gives up on such a worker's handoff (re-dispatch,
transfer failure or timeout) the request's blocks are held here, out of use, until one of:

- that worker's PrefillDone for the request arrives (it sends one after every abort, once its
  writes are done: it owns no destination block after it);
- the worker is registered again under a new run (``started_at``): the old process has ended;
- it ran on this host, in this PID namespace, and its process is gone;
- ``timeout_s`` passed (the request's transfer timeout: a worker frozen longer is not waited for).

Plain Python; the decode worker frees what ``release_*`` returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.cluster.process import process_exists


@dataclass
class _Held:
    request_id: str
    worker_id: str
    started_at: float | None
    pid: int | None  # the worker's process, when it runs on this host in our PID namespace
    block_ids: list[int]
    since: float


class Quarantine:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._held: list[_Held] = []

    @property
    def num_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._held)

    def hold(self, request_id: str, worker_id: str, started_at: float | None, pid: int | None,
             block_ids: list[int], now: float | None = None) -> None:
        if block_ids:
            self._held.append(_Held(request_id, worker_id, started_at, pid, list(block_ids),
                                    time.monotonic() if now is None else now))

    def release_done(self, request_id: str, worker_id: str) -> list[int]:
        """The worker's PrefillDone for the request: it writes none of those blocks any more."""
        return self._release(lambda h: h.request_id == request_id and h.worker_id == worker_id)

    def release_ended(self, alive: dict[str, float], now: float | None = None) -> list[int]:
        """Blocks of workers whose run ended (registered again under a new run, or their process
        on this host is gone) or that were held past the timeout. ``alive``: id -> started_at."""
        now = time.monotonic() if now is None else now

        def ended(h: _Held) -> bool:
            restarted = h.worker_id in alive and alive[h.worker_id] != h.started_at
            return restarted or (h.pid is not None and not process_exists(h.pid)) or now - h.since >= self.timeout_s

        return self._release(ended)

    def _release(self, done) -> list[int]:
        """Drop the entries ``done`` says are over (asked once each: it may make a system call)."""
        kept, released = [], []
        for h in self._held:
            (released if done(h) else kept).append(h)
        self._held = kept
        return [b for h in released for b in h.block_ids]
