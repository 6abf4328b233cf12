"""A worker's inbox: a Redis stream read through a consumer group.

Entries are read with NOACK (one round trip a read): a message counts as
delivered once a worker has taken it, and is then deleted from the stream
(which would otherwise keep every prompt ever sent). Reclaiming what a crashed
worker had taken would need acknowledging after handling instead; it is not
built. A Redis restarted without its data has lost the consumer group: the
next read recreates it (NOGROUP) instead of failing for ever.

An entry that is not a valid message (``tandem.cluster.messages``: bad bytes, a
field of the wrong type or range) is logged and dropped; one whose map still
names a request (a string ``request_id``) is handed to the worker as an
``Unreadable`` in its place, so that the request can be failed instead of left
waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.messages import FIELD, MessageError, decode, encode, named

log = structlog.get_logger(__name__)


def send(client: redis.Redis, stream: str, msg: Any) -> None:
    client.xadd(stream, {FIELD: encode(msg)})


@dataclass
class Unreadable:
    """An inbox entry that is no valid message but names a request: ``body`` is its map, for
    ``messages.named`` to read what else it names."""

    entry_id: Any
    error: str
    body: dict

    kind = "unreadable"


def read_entry(entry_id: Any, fields: dict) -> Any:
    """One stream entry -> its message; an invalid one is logged and gives an Unreadable when it
    names a request, else None."""
    try:
        return decode(fields[FIELD])
    except KeyError:
        error, body = f"no {FIELD!r} field", {}
    except MessageError as exc:
        error, body = str(exc), exc.body
    log.error("invalid inbox entry dropped", entry_id=entry_id, error=error,
              kind=named(body, "kind"), request_id=named(body, "request_id"))
    return Unreadable(entry_id, error, body) if named(body, "request_id") else None


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
        """Take up to ``count`` new messages (an Unreadable for an invalid one that names a
        request); wait up to ``block_ms`` if none (None = don't wait)."""
        try:
            reply = self._client.xreadgroup(
                keys.GROUP, self._consumer, {self.stream: ">"}, count=count, block=block_ms, noack=True
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("inbox consumer group gone (redis restarted without its data); recreating it",
                        stream=self.stream)
            self.ensure_group()
            return []
        messages, taken = [], []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                taken.append(entry_id)
                msg = read_entry(entry_id, fields)
                if msg is not None:
                    messages.append(msg)
        if taken:  # delivered (NOACK): nothing reads them again
            try:
                self._client.xdel(self.stream, *taken)
            except redis.RedisError as exc:  # they stay in the stream, unread; what was read is kept
                log.warning("could not delete read inbox entries", stream=self.stream, error=str(exc))
        return messages


class Mailer:
    """Control messages (PrefillDone, AbortRequest) on their way to other workers' inboxes:
    kept across a Redis error and sent, in order, before anything newer (``flush`` at the start
    of each loop turn). A message a lost reply makes us send twice is handled as a stale one
    by its receiver."""

    def __init__(self, client: redis.Redis):
        self._client = client
        self._pending: list[tuple[str, Any]] = []

    def send(self, stream: str, msg: Any) -> None:
        """Queue ``msg`` after anything still pending and try to deliver all; a RedisError keeps them."""
        self._pending.append((stream, msg))
        self.flush()

    def flush(self) -> None:
        while self._pending:
            stream, msg = self._pending[0]
            send(self._client, stream, msg)
            self._pending.pop(0)

    @property
    def num_pending(self) -> int:
        return len(self._pending)
