"""Publishing TokenEvents: one Redis entry per gateway per step.

A request carries ``reply_to``, its gateway's output stream. A worker queues
all events of one step on a pipeline with ``queue_events``: the events bound
for one gateway travel as one TokenBatch entry, so a decode step over a batch
of B requests costs one XADD per gateway, not B.
"""

from __future__ import annotations

from collections import defaultdict

from tandem.cluster import keys
from tandem.cluster.messages import FIELD, TokenBatch, TokenEvent, encode


def queue_events(pipe, events: list[tuple[str, TokenEvent]]) -> None:
    """Queue XADDs for ``(reply_to, event)`` pairs on a redis pipeline (the caller executes it)."""
    by_stream: dict[str, list[TokenEvent]] = defaultdict(list)
    for reply_to, event in events:
        by_stream[reply_to].append(event)
    for stream, batch in by_stream.items():
        pipe.xadd(stream, {FIELD: encode(TokenBatch.of(batch))}, maxlen=keys.GATEWAY_OUTPUT_MAXLEN, approximate=True)


class Outbox:
    """Events on their way to Redis: kept across a Redis error and sent first on the next try.

    A worker appends every step's events with ``send``; if Redis is away they
    stay here (their tokens are already recorded by the scheduler, so dropping
    them would leave a hole the gateway waits on), and ``flush`` at the start
    of a later step delivers them before anything newer. The gateway orders
    and deduplicates by output index, so a retried entry is harmless.
    """

    def __init__(self, client):
        self._client = client
        self._pending: list[tuple[str, TokenEvent]] = []

    def send(self, events: list[tuple[str, TokenEvent]]) -> None:
        """Queue ``events`` after anything still pending and try to deliver all in one round trip."""
        self.keep(events)
        self.flush()

    def keep(self, events: list[tuple[str, TokenEvent]]) -> None:
        """Queue ``events`` for the next ``flush`` (no Redis call: cannot fail)."""
        self._pending.extend(events)

    def flush(self) -> None:
        if not self._pending:
            return
        pipe = self._client.pipeline(transaction=False)
        queue_events(pipe, self._pending)
        pipe.execute()  # a RedisError leaves everything pending
        self._pending = []

    @property
    def num_pending(self) -> int:
        return len(self._pending)
