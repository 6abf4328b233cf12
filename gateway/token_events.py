"""Reading a request's TokenEvents: events in, ordered new tokens out.

``read_queued_events`` takes the events the gateway's ``OutputMux`` routes to
the request's queue. While nothing arrives it checks, once per ``poll_s``,
that the decode worker holding the request is still alive (its registry key
exists) and that the request's deadline has not passed, so a dead worker or a
stuck request ends with ``WorkerLost`` / ``RequestTimeout`` instead of
hanging.

``TokenAssembler`` turns events into the next contiguous tokens: the prefill
worker writes index 0 and the decode worker the rest, and after a retry the
same positions may arrive twice, so events are ordered and deduplicated by
index.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from tandem.cluster.messages import TokenEvent
from tandem.gateway.errors import RequestTimeout, WorkerLost

log = structlog.get_logger(__name__)

POLL_S = 0.5


async def read_queued_events(
    queue: "asyncio.Queue[TokenEvent]",
    *,
    deadline: float,
    worker_alive: Callable[[], Awaitable[bool]],
    poll_s: float = POLL_S,
) -> AsyncIterator[list[TokenEvent]]:
    """The TokenEvents put on ``queue``, forever (the caller stops at the last one), each time
    all that arrived since the last: a reader that fell behind the workers takes several steps'
    tokens in one go, so the stream's cost per token falls as the load rises (one delta, one SSE
    event for the lot, as vLLM's output collector merges outputs its consumer has not taken)."""
    while True:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise RequestTimeout("request timed out")
        if queue.empty():
            try:
                event = await asyncio.wait_for(queue.get(), timeout=min(poll_s, remaining_s))
            except asyncio.TimeoutError:
                if not await worker_alive() and queue.empty():
                    raise WorkerLost("the decode worker serving this request stopped responding") from None
                continue
        else:
            event = queue.get_nowait()  # what arrived meanwhile, without a timer
        batch = [event]
        while not queue.empty():
            batch.append(queue.get_nowait())
        failed = next((i for i, item in enumerate(batch) if isinstance(item, Exception)), None)
        if failed is None:
            yield batch
            continue
        if failed:  # the events before the gateway's own end (OutputMux.fail_all) still go out
            yield batch[:failed]
        raise batch[failed]


@dataclass
class TokenAssembler:
    """Events (any order, with repeats) -> the next contiguous output tokens."""

    num_tokens: int = 0  # output tokens released so far
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: list = field(default_factory=list)  # the logprobs entries of add's last tokens (None: none)
    _pending: dict[int, TokenEvent] = field(default_factory=dict)
    _gap_since: float | None = None  # monotonic: since when later tokens wait for a missing one

    def gap_s(self) -> float:
        """How long later tokens have waited for an earlier one that has not come (0: no gap).
        Events lost in transit (a Redis that lost its data before the gateway read them) leave
        such a gap for good: the request is then failed over and its tokens recomputed."""
        return 0.0 if self._gap_since is None else time.monotonic() - self._gap_since

    def add(self, event: TokenEvent) -> list[int]:
        """Tokens that became contiguous with this event; sets ``finish_reason`` when the end arrives.
        Their logprobs entries (one per token, None where the event had none) are in ``new_logprobs``."""
        self.new_logprobs = []
        if self.finish_reason is not None:
            return []
        self._pending[event.index] = _merge(self._pending.get(event.index), event)
        new_token_ids: list[int] = []
        while True:
            ready = [i for i in self._pending if i <= self.num_tokens]
            if not ready:
                break
            for index in sorted(ready):
                item = self._pending.pop(index)
                fresh = item.token_ids[self.num_tokens - index :]
                new_token_ids.extend(fresh)
                entries = item.logprobs or [None] * len(item.token_ids)
                self.new_logprobs.extend(entries[self.num_tokens - index :])
                self.num_tokens += len(fresh)
                if item.finish_reason is not None:  # the last event (it may repeat known tokens)
                    self.finish_reason, self.error = item.finish_reason, item.error
                    self._pending.clear()
                    self._gap_since = None
                    return new_token_ids
        if not self._pending:
            self._gap_since = None
        elif self._gap_since is None or new_token_ids:
            self._gap_since = time.monotonic()  # a (new) gap opens
        return new_token_ids

    def forget_pending(self) -> None:
        """Drop events past the released tokens (a lost worker's; they are generated again)."""
        self._pending.clear()
        self._gap_since = None


def _merge(old: TokenEvent | None, new: TokenEvent) -> TokenEvent:
    """Two events at one index: keep the longer, and any finish reason either carries."""
    if old is None:
        return new
    keep = new if len(new.token_ids) >= len(old.token_ids) else old
    if keep.finish_reason is None and (old.finish_reason or new.finish_reason):
        other = old if keep is new else new
        if len(other.token_ids) == len(keep.token_ids):
            return other
    return keep
