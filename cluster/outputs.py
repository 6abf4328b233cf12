"""Publishing TokenEvents: one Redis entry per gateway per step.

A request carries ``reply_to``, its gateway's output stream. A worker queues
all events of one step on a pipeline with ``queue_events``: the events bound
for one gateway travel as one TokenBatch entry, so a decode step over a batch
of B requests costs one XADD per gateway, not B. A request without
``reply_to`` gets a stream of its own (``keys.output``), which expires.
"""

from __future__ import annotations

from collections import defaultdict

from cluster import keys
from cluster.messages import FIELD, TokenBatch, TokenEvent, encode


def queue_events(pipe, events: list[tuple[str, TokenEvent]]) -> None:
    """Queue XADDs for ``(reply_to, event)`` pairs on a redis pipeline (the caller executes it)."""
    by_stream: dict[str, list[TokenEvent]] = defaultdict(list)
    for reply_to, event in events:
        if reply_to:
            by_stream[reply_to].append(event)
        else:
            stream = keys.output(event.request_id)
            pipe.xadd(stream, {FIELD: encode(event)})
            ttl = keys.OUTPUT_TTL_S if event.finish_reason is None else keys.FINISHED_OUTPUT_TTL_S
            pipe.expire(stream, ttl)
    for stream, batch in by_stream.items():
        pipe.xadd(stream, {FIELD: encode(TokenBatch.of(batch))}, maxlen=keys.GATEWAY_OUTPUT_MAXLEN, approximate=True)
