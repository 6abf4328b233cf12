"""A worker's inbox: a Redis stream read through a consumer group.

Entries are read with NOACK (one round trip a read): a message counts as
delivered once a worker has taken it. Reclaiming what a crashed worker had
taken would need acknowledging after handling instead; it is not built.
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
            keys.GROUP, self._consumer, {self.stream: ">"}, count=count, block=block_ms, noack=True
        )
        messages = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                try:
                    messages.append(decode(fields[FIELD]))
                except (MessageError, KeyError) as exc:
                    log.error("dropping unreadable inbox entry", entry_id=entry_id, error=str(exc))
        return messages
