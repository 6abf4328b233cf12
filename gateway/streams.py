"""Reading a request's output stream: TokenEvents in, ordered new tokens out.

``read_events`` follows ``tandem:out:<request_id>`` with blocking XREAD from
the start. While nothing arrives it checks, once per ``poll_s``, that the
decode worker holding the request is still alive (its registry key exists) and
that the request's deadline has not passed, so a dead worker or a stuck
request ends with ``WorkerLost`` / ``RequestTimeout`` instead of hanging.

``TokenAssembler`` turns events into the next contiguous tokens: the prefill
worker writes index 0 and the decode worker the rest, and after a retry the
same positions may arrive twice, so events are ordered and deduplicated by
index.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog

from cluster.messages import FIELD, MessageError, TokenEvent, decode
from gateway.errors import RequestTimeout, WorkerLost

log = structlog.get_logger(__name__)

POLL_S = 0.5


async def read_events(
    client: aioredis.Redis,
    stream: str,
    *,
    deadline: float,
    worker_alive: Callable[[], Awaitable[bool]],
    poll_s: float = POLL_S,
) -> AsyncIterator[TokenEvent]:
    """Every TokenEvent written to ``stream``, forever (the caller stops at the last one).

    ``deadline`` is on the ``time.monotonic()`` clock.
    """
    last_id = "0-0"
    while True:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise RequestTimeout("request timed out")
        block_ms = max(1, int(min(poll_s, remaining_s) * 1000))
        reply = await client.xread({stream: last_id}, block=block_ms)
        if not reply and not await worker_alive():
            reply = await client.xread({stream: last_id})  # anything it wrote just before dying
            if not reply:
                raise WorkerLost("the decode worker serving this request stopped responding")
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                last_id = entry_id
                try:
                    yield decode(fields[FIELD])
                except (MessageError, KeyError) as exc:
                    log.error("dropping unreadable output entry", entry_id=entry_id, error=str(exc))


@dataclass
class TokenAssembler:
    """Events (any order, with repeats) -> the next contiguous output tokens."""

    num_tokens: int = 0  # output tokens released so far
    finish_reason: str | None = None
    error: str | None = None
    _pending: dict[int, TokenEvent] = field(default_factory=dict)

    def add(self, event: TokenEvent) -> list[int]:
        """Tokens that became contiguous with this event; sets ``finish_reason`` when the end arrives."""
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
                self.num_tokens += len(fresh)
                if item.finish_reason is not None:  # the last event (it may repeat known tokens)
                    self.finish_reason, self.error = item.finish_reason, item.error
                    self._pending.clear()
                    return new_token_ids
        return new_token_ids


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
