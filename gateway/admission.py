"""Waiting for room: requests no decode worker can take now queue here, bounded in length and time.

    arrive --a worker takes it, nobody queued--> ADMITTED
       |--queue holds max_queue_len already--> REJECTED (429, code queue_full)
       +--> QUEUED --at the head, a worker takes it--> ADMITTED
                 +--waited queue_timeout_s--> REJECTED (429, code queue_timeout)

The queue is ordered by (priority, arrival) like the workers' own queues. Only
its head asks Redis (``Router.reserve``, every ``poll_s``), so requests are
admitted in order and a waiting crowd costs one Redis call per poll. A waiter
that is cancelled, or whose ``client_gone`` says its client went away (asked
every ``CLIENT_CHECK_S``: ClientDisconnected), just leaves the queue. With no
decode worker alive at all, ``NoWorkerAvailable`` (503) is raised at once instead.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Awaitable, Callable

from tandem.cluster.messages import WorkerInfo
from tandem.gateway.errors import ClientDisconnected, RequestTimeout, ServerBusy
from tandem.gateway.router import Router

POLL_S = 0.01
CLIENT_CHECK_S = 0.1  # how often a waiter asks whether its client is still there
RESUMED_FIRST = 1 << 60  # subtracted from a resumed request's arrival number: ahead of new ones, FIFO among themselves


class AdmissionQueue:
    def __init__(self, router: Router, *, max_queue_len: int, queue_timeout_s: float, poll_s: float = POLL_S):
        self.router = router
        self.max_queue_len = max_queue_len
        self.queue_timeout_s = queue_timeout_s
        self.poll_s = poll_s
        self._waiting: list[tuple[int, int]] = []  # (priority, arrival number), sorted
        self._arrivals = itertools.count()

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    async def admit(self, request_id: str, num_prompt_tokens: int, max_tokens: int, priority: int = 0,
                    resumed: bool = False, deadline: float | None = None,
                    client_gone: Callable[[], Awaitable[bool]] | None = None) -> WorkerInfo:
        """The worker that took the request (its reservation is made); waits in the queue if none can yet.

        ``resumed``: a request already streaming whose decode worker was lost; it goes ahead of
        the new requests of its priority and is never refused for a full queue. ``deadline``
        (monotonic): the request's own; reaching it raises RequestTimeout. (A deadline, not
        ``asyncio.wait_for``: a cancellation landing inside a redis-py call can be lost.)
        ``client_gone``: asked while queued; True raises ClientDisconnected."""
        reserve = (request_id, num_prompt_tokens, max_tokens, resumed)
        if not self._waiting:
            worker = await self.router.reserve(*reserve)
            if worker is not None:
                return worker
        if len(self._waiting) >= self.max_queue_len and not resumed:
            raise ServerBusy(f"all decode workers are full and {len(self._waiting)} requests are queued; "
                             "retry later", code="queue_full")
        ticket = (priority, next(self._arrivals) - (RESUMED_FIRST if resumed else 0))
        bisect.insort(self._waiting, ticket)
        queue_deadline = time.monotonic() + self.queue_timeout_s
        request_deadline = float("inf") if deadline is None else deadline
        next_client_check = time.monotonic() + CLIENT_CHECK_S
        try:
            while True:
                if self._waiting[0] == ticket:
                    worker = await self.router.reserve(*reserve)
                    if worker is not None:
                        return worker
                now = time.monotonic()
                if client_gone is not None and now >= next_client_check:
                    if await client_gone():
                        raise ClientDisconnected("client disconnected while queued")
                    next_client_check = now + CLIENT_CHECK_S
                if now >= request_deadline:
                    raise RequestTimeout("request timed out waiting for room on a decode worker")
                remaining_s = min(queue_deadline, request_deadline) - now
                if queue_deadline <= now:
                    raise ServerBusy(f"no decode worker had room within {self.queue_timeout_s:g} s; retry later",
                                     code="queue_timeout")
                await asyncio.sleep(min(self.poll_s, remaining_s))
        finally:
            self._waiting.remove(ticket)
