"""Worker registry: heartbeats as Redis keys with a TTL.

A worker is alive exactly while its key exists. ``Heartbeat`` refreshes the
key from a background thread (so a long forward pass does not look like a
death) with the load snapshot the worker loop last published. Each beat first
makes sure the run's liveness subscription is held (``tandem.cluster.liveness``):
a peer that finds it gone and the record a beat late knows the process died,
without waiting for the key to expire.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.liveness import LivenessChannel
from tandem.cluster.messages import MessageError, WorkerInfo, decode, encode

log = structlog.get_logger(__name__)


def live_workers(client: redis.Redis, role: str) -> list[WorkerInfo]:
    """Every worker of ``role`` whose heartbeat has not expired."""
    names = list(client.scan_iter(match=keys.worker_pattern(role), count=1000))
    return parse_records(role, client.mget(names), names) if names else []


# (key, error) of the records already reported unreadable: a bad record is read again with every
# refresh (several a second), and is logged once. Bounded: forgotten wholesale when full.
_reported: set[tuple[str, str]] = set()
MAX_REPORTED = 1024


def parse_records(role: str, raws: list[bytes | None], names: list | None = None) -> list[WorkerInfo]:
    """Registry values (MGET of the worker keys ``names``) -> records, skipping expired ones and
    unreadable ones (a bad type or range in any field, a record of another kind or role): those
    are logged once each, and never reach a caller that would compute with their fields."""
    workers = []
    for i, raw in enumerate(raws):
        if raw is None:
            continue  # expired between SCAN and MGET
        key = names[i] if names is not None else ""
        key = key.decode(errors="replace") if isinstance(key, bytes) else key
        try:
            info = decode(raw)
            if not isinstance(info, WorkerInfo) or info.role != role:
                raise MessageError(f"not a {role} worker's record: {info.kind} "
                                   f"{getattr(info, 'role', '')}".rstrip())
        except MessageError as exc:  # e.g. a newer worker during a rolling upgrade
            _report(role, key, str(exc))
            continue
        workers.append(info)
    return workers


def _report(role: str, key: str, error: str) -> None:
    if (key, error) in _reported:
        return
    if len(_reported) >= MAX_REPORTED:
        _reported.clear()
    _reported.add((key, error))
    log.error("unreadable registry record skipped", role=role, key=key, error=error)


def of_model(workers: list[WorkerInfo], model: str, reported: set[tuple[str, str]]) -> list[WorkerInfo]:
    """The workers serving ``model``; each other one is logged once (``reported`` remembers
    (role, id)): workers of another model sharing the Redis are another cluster's, or a
    service given a different --served-model-name."""
    for w in workers:
        if w.model != model and (w.role, w.worker_id) not in reported:
            reported.add((w.role, w.worker_id))
            log.warning("ignoring a worker that serves another model (give every service the same "
                        "--served-model-name)", role=w.role, worker_id=w.worker_id, worker_model=w.model,
                        model=model)
    return [w for w in workers if w.model == model]


class Heartbeat:
    """Publishes ``snapshot()`` under the worker's key every ``interval_s``."""

    def __init__(
        self,
        redis_url: str,
        snapshot: Callable[[], WorkerInfo],
        interval_s: float = 1.0,
        ttl_s: float = 5.0,
    ):
        self._client = redis.Redis.from_url(redis_url, socket_timeout=ttl_s)
        self._redis_url = redis_url
        self._liveness: LivenessChannel | None = None  # made at the first beat (the run's identity is known then)
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._ttl_ms = int(ttl_s * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        info = self._snapshot()
        if self._liveness is None and info.liveness_channel:
            self._liveness = LivenessChannel(self._redis_url, info.liveness_channel, self._ttl_ms / 1000)
        if self._liveness is not None:
            self._liveness.ensure()  # before the record: a record it names is held when written
        info.heartbeat_at = time.time()
        self._client.set(keys.worker(info.role, info.worker_id), encode(info), px=self._ttl_ms)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.beat()
            except redis.RedisError as exc:
                # Redis away: keep trying; the key expires and we re-register after.
                log.warning("heartbeat failed", error=str(exc))

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._liveness is not None:
            self._liveness.close()
        if deregister:
            info = self._snapshot()
            try:
                self._client.delete(keys.worker(info.role, info.worker_id))
            except redis.RedisError:
                pass
