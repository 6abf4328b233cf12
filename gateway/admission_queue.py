"""Waiting for room: requests no decode worker can take now queue here, in order, until one can.

    arrive --a worker takes it, nobody queued--> ADMITTED
       |--an operator's max_queue_len is reached--> REJECTED (429, code queue_full)
       +--> QUEUED --at the head, a worker takes it--> ADMITTED
                 +--an operator's queue_timeout_s passed--> REJECTED (429, code queue_timeout)

By default the queue has neither bound: an offline batch sent at once is served whole, each
request when memory frees up, as in vLLM; refusal is an operator's explicit choice
(``--max-queue-len``, ``--queue-timeout-s``). The queue is ordered by (priority, arrival) like
the workers' own queues. Only its head asks Redis (``Router.reserve``, every ``poll_s``), so
requests are admitted in order and a waiting crowd costs one Redis call per poll and nothing
in Redis; the others sleep until they reach the head, their client leaves (``client_left``,
set by the gateway's disconnect watch: ClientDisconnected) or a deadline passes, and wake for
nothing else: 10,000 waiting requests cost the event loop no work. With no decode worker alive
at all, ``NoWorkerAvailable`` (503) is raised at once instead.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time

from tandem.cluster.messages import WorkerInfo
from tandem.gateway.errors import ClientDisconnected, RequestTimeout, ServerBusy
from tandem.gateway.router import PromptPrefix, Router

POLL_S = 0.01  # the head's retry interval
RESUMED_FIRST = 1 << 60  # subtracted from a resumed request's arrival number: ahead of new ones, FIFO among themselves


class _Ticket:
    """A place in the queue: its order key and the event that says it reached the head."""

    __slots__ = ("key", "turn")

    def __init__(self, key: tuple[int, int]):
        self.key = key
        self.turn = asyncio.Event()

    def __lt__(self, other: _Ticket) -> bool:
        return self.key < other.key


class AdmissionQueue:
    def __init__(self, router: Router, *, max_queue_len: int | None = None, queue_timeout_s: float | None = None,
                 poll_s: float = POLL_S, queued_gauge=None):
        """``max_queue_len``: requests held at most (0: none, refused at once when no worker has
        room; None: no bound); ``queue_timeout_s``: longest wait (None: no bound)."""
        self.router = router
        self.max_queue_len = max_queue_len
        self.queue_timeout_s = queue_timeout_s
        self.poll_s = poll_s
        self._waiting: list[_Ticket] = []  # sorted by (priority, arrival number)
        self._arrivals = itertools.count()
        self._gauge = queued_gauge  # a prometheus Gauge that follows num_queued (None: none)

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    async def admit(self, request_id: str, num_prompt_tokens: int, max_tokens: int, priority: int = 0,
                    resumed: bool = False, deadline: float | None = None,
                    client_left: asyncio.Event | None = None,
                    prompt: PromptPrefix | None = None) -> WorkerInfo:
        """The worker that took the request (its reservation is made); waits in the queue if none can yet.

        ``resumed``: a request already streaming whose decode worker was lost; it goes ahead of
        the new requests of its priority and is never refused for a full queue. ``deadline``
        (monotonic): the request's own; reaching it raises RequestTimeout. (A deadline, not
        ``asyncio.wait_for``: a cancellation landing inside a redis-py call can be lost.)
        ``client_left``: set when the client goes away, which raises ClientDisconnected if the
        request is still queued. ``prompt``: for prefix-aware admission (``Router.reserve``)."""
        reserve = (request_id, num_prompt_tokens, max_tokens, resumed)
        if not self._waiting:
            worker = await self.router.reserve(*reserve, prompt=prompt)
            if worker is not None:
                return worker
        if self.max_queue_len is not None and len(self._waiting) >= self.max_queue_len and not resumed:
            raise ServerBusy(f"all decode workers are full and {len(self._waiting)} requests are queued; "
                             "retry later", code="queue_full")
        ticket = _Ticket((priority, next(self._arrivals) - (RESUMED_FIRST if resumed else 0)))
        bisect.insort(self._waiting, ticket)
        if self._gauge is not None:
            self._gauge.inc()
        self._waiting[0].turn.set()  # a ticket that went ahead of the head is the head now
        queue_deadline = float("inf") if self.queue_timeout_s is None else time.monotonic() + self.queue_timeout_s
        wake_at = min(queue_deadline, float("inf") if deadline is None else deadline)
        try:
            while True:
                if client_left is not None and client_left.is_set():
                    raise ClientDisconnected("client disconnected while queued")
                head = self._waiting[0] is ticket
                if head:
                    worker = await self.router.reserve(*reserve, prompt=prompt)
                    if worker is not None:
                        return worker
                else:
                    ticket.turn.clear()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise RequestTimeout("request timed out waiting for room on a decode worker")
                if queue_deadline <= now:
                    raise ServerBusy(f"no decode worker had room within {self.queue_timeout_s:g} s; retry later",
                                     code="queue_timeout")
                if head:
                    await asyncio.sleep(max(0.0, min(self.poll_s, wake_at - now)))
                elif self._waiting[0] is not ticket:  # (the head may have left meanwhile)
                    await _first_set(ticket.turn, client_left, timeout=wake_at - now)
        finally:
            self._waiting.remove(ticket)
            if self._gauge is not None:
                self._gauge.dec()
            if self._waiting:
                self._waiting[0].turn.set()


async def _first_set(turn: asyncio.Event, client_left: asyncio.Event | None, timeout: float) -> None:
    """Until ``turn`` or ``client_left`` is set, or ``timeout`` (inf: none) seconds passed."""
    waits = [asyncio.ensure_future(turn.wait())]
    if client_left is not None:
        waits.append(asyncio.ensure_future(client_left.wait()))
    try:
        await asyncio.wait(waits, timeout=None if timeout == float("inf") else max(0.0, timeout),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
