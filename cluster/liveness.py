"""Liveness connections: telling a dead worker process from a live one within a heartbeat.

A registry record lives for the heartbeat TTL after its worker's last beat (5 s by default),
so a peer that waits for it to expire learns of a death that late. Each run of a worker
therefore also holds one Redis connection subscribed to its own channel
(``keys.liveness(role, worker id, started_at)``, named in its record as ``liveness_channel``,
made again by every beat after Redis lost it). When the process dies its kernel closes the
socket, and Redis drops the subscription at once; ``ended_runs`` asks Redis (``PUBSUB NUMSUB``
and the records' ``PTTL``, one round trip) which runs lost theirs.

A run counts as ended only when both are true: no subscription, and no beat for more than
``LATE_BEATS`` of its heartbeat intervals (its record's age, from ``PTTL``: Redis's clock; the
interval and TTL as its record gives them). A live process whose connection dropped (a network
blip, a Redis restart) subscribes again with its next beat, well inside that; a live process
whose beats are late (a stall) still holds its connection. So a worker is taken for dead within
about 1.5 heartbeat intervals of its death instead of a TTL, and never while it beats. Nor in a
Redis's first moments (``INFO``'s uptime): restarted from its files it has the records but none
of the subscriptions, which the workers make again with their next beats. A Redis that refuses
pub/sub (an ACL) leaves the registry's TTL as the only rule: its subscription is never made and
its peers' question is never answered, and each logs that once.
"""

from __future__ import annotations

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.messages import WorkerInfo

log = structlog.get_logger(__name__)

LATE_BEATS = 1.5  # a record this many heartbeat intervals old has missed a beat


class LivenessChannel:
    """The worker's side: one connection subscribed to its run's channel, for as long as the
    process lives. ``ensure()`` (every beat) checks it with a PING and subscribes again on a
    fresh connection when it is gone."""

    def __init__(self, redis_url: str, channel: str, timeout_s: float):
        self.channel = channel
        # RESP2: the subscription's replies are plain arrays, read like any other (RESP3 pushes)
        self._pool = redis.ConnectionPool.from_url(redis_url, socket_timeout=timeout_s,
                                                   socket_connect_timeout=timeout_s, protocol=2)
        self._connection = None
        self._refused = False  # Redis refuses SUBSCRIBE (an ACL): the TTL alone tells our death

    def ensure(self) -> None:
        """Subscribed on a live connection (raises redis.ConnectionError while Redis is away)."""
        if self._refused:
            return
        if self._connection is not None:
            try:
                self._connection.send_command("PING")
                self._connection.read_response()  # subscribed: [b"pong", b""]
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self.close()  # dropped (a Redis restart, a broken socket): subscribe again
        connection = self._pool.make_connection()
        try:
            connection.connect()
            connection.send_command("SUBSCRIBE", self.channel)
            connection.read_response()
        except redis.ResponseError as exc:
            connection.disconnect()
            self._refused = True
            log.warning("redis refused the liveness subscription: peers learn of this worker's death "
                        "from its heartbeat's TTL only", channel=self.channel, error=str(exc))
            return
        except BaseException:
            connection.disconnect()
            raise
        self._connection = connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.disconnect()
            self._connection = None


_unanswered: set[str] = set()  # roles whose question Redis refused (logged once)


def ended_runs(client: redis.Redis, role: str, workers: list[WorkerInfo]) -> set[tuple[str, float]]:
    """(worker id, started_at) of the ``workers`` (registry records of ``role``) whose process is
    gone: no subscription on the channel their record names, and a record older than LATE_BEATS
    of their heartbeat intervals. A record that names no channel or interval (a worker of an
    older version) is left to its TTL."""
    watched = [w for w in workers if w.liveness_channel and w.heartbeat_interval_s > 0 and w.heartbeat_ttl_s > 0]
    if not watched:
        return set()
    pipe = client.pipeline(transaction=False)
    pipe.info("server")
    pipe.pubsub_numsub(*[w.liveness_channel for w in watched])
    for w in watched:
        pipe.pttl(keys.worker(role, w.worker_id))
    server, counts, *ttls_ms = pipe.execute(raise_on_error=False)
    refused = next((r for r in (counts, *ttls_ms) if isinstance(r, redis.ResponseError)), None)
    if refused is not None:  # NUMSUB not allowed (an ACL): the TTL alone decides
        if role not in _unanswered:
            _unanswered.add(role)
            log.warning("redis refused the liveness check: lost workers are found by their heartbeat's TTL",
                        role=role, error=str(refused))
        return set()
    for result in (server, counts, *ttls_ms):
        if isinstance(result, Exception):
            raise result  # Redis away: the caller's loop waits it out
    # a Redis restarted from its files has the records and none of the subscriptions: every
    # worker subscribes again with its next beat, so nothing counts until all had the time to
    uptime_s = server.get("uptime_in_seconds") if isinstance(server, dict) else None
    if isinstance(uptime_s, int) and uptime_s <= max(LATE_BEATS * w.heartbeat_interval_s for w in watched):
        return set()
    ended = set()
    for w, (_channel, count), ttl_ms in zip(watched, counts, ttls_ms):
        if count:
            continue  # its process holds the subscription
        age_ms = w.heartbeat_ttl_s * 1000 - ttl_ms
        if ttl_ms == -2 or (ttl_ms >= 0 and age_ms > LATE_BEATS * w.heartbeat_interval_s * 1000):
            ended.add((w.worker_id, w.started_at))  # its record expired meanwhile, or it missed a beat
    return ended
