"""A worker's inbox: a Redis stream read through a consumer group.

Consumer groups keep unacknowledged entries pending, so a later recovery step
can reclaim what a crashed worker had taken. Entries are acknowledged once
handled.
"""

from __future__ import annotations

from typing import Any

import redis
import structlog

from cluster import keys
from cluster.messages import FIELD, MessageError, decode, encode

log = structlog.get_logger(__name__)


def send(client: redis.Redis, stream: str, msg: Any) -> None:
    client.xadd(stream, {FIELD: encode(msg)})


class Inbox:
    def __init__(self, client: redis.Redis, stream: str, consumer: str):
        self._client = client
        self.stream = stream
        self._consumer = consumer
        self.ensure_group()

    def ensure_group(self) -> None:
        try:
            self._client.xgroup_create(self.stream, keys.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, block_ms: int | None, count: int = 256) -> list[Any]:
        """Take up to ``count`` new messages; wait up to ``block_ms`` if none (None = don't wait)."""
        reply = self._client.xreadgroup(
            keys.GROUP, self._consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        messages, entry_ids = [], []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                entry_ids.append(entry_id)
                try:
                    messages.append(decode(fields[FIELD]))
                except (MessageError, KeyError) as exc:
                    log.error("dropping unreadable inbox entry", entry_id=entry_id, error=str(exc))
        if entry_ids:
            self._client.xack(self.stream, keys.GROUP, *entry_ids)
        return messages
