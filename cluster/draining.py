"""Draining: workers that get no new requests while they finish what they hold.

The admin API (``tandem.gateway.admin``) marks a worker in ``keys.draining(role)``, a hash
worker_id -> the ``started_at`` of the run it drains and the time of the drain. Routers skip a marked
worker: the gateways when they admit a request to a decode worker (``tandem.gateway.router``),
the decode workers when they hand a prefill job out (``tandem.decode.worker``). The mark names
one incarnation, so a worker restarted under its id (compose and ``tandem serve`` use
fixed ids) takes work again without an undrain; marks of runs replaced by a new one are
pruned at the next drain. Marks live in Redis: a Redis restarted without its data forgets
them (and the live policies). Torch-free.
"""

from __future__ import annotations

from typing import NamedTuple

from tandem.cluster import keys
from tandem.cluster.messages import WorkerInfo

# A drain has reached every router once it is this old: a gateway's registry snapshot is at most
# 0.25 s old (gateway.router.CACHE_TTL_S), a decode worker re-reads its peers every 0.5 s.
SETTLE_S = 1.0


class Mark(NamedTuple):
    started_at: float  # the run of the worker being drained
    marked_at: float  # when (Unix seconds, the marking gateway's clock)


def parse_marks(raw: dict) -> dict[str, Mark]:
    """HGETALL of ``keys.draining(role)`` -> worker_id -> Mark (unreadable fields skipped)."""
    marks = {}
    for worker_id, value in raw.items():
        try:
            started_at, marked_at = (float(x) for x in _text(value).split())
        except ValueError:
            continue
        marks[_text(worker_id)] = Mark(started_at, marked_at)
    return marks


def is_draining(worker: WorkerInfo, marks: dict[str, Mark]) -> bool:
    mark = marks.get(worker.worker_id)
    return mark is not None and mark.started_at == worker.started_at


def is_drained(worker: WorkerInfo, marks: dict[str, Mark], num_admitted: int = 0) -> bool:
    """Draining, and holding nothing by a heartbeat taken after every router saw the drain
    (a decode worker also has no admitted request still on its way in): safe to stop."""
    return (is_draining(worker, marks) and worker.heartbeat_at >= marks[worker.worker_id].marked_at + SETTLE_S
            and worker.num_running == 0 and worker.num_waiting == 0 and num_admitted == 0)


def accepting(workers: list[WorkerInfo], marks: dict[str, Mark]) -> list[WorkerInfo]:
    """The workers that take new requests."""
    return [w for w in workers if not is_draining(w, marks)]


def read_marks(client, role: str) -> dict[str, Mark]:
    """The drain marks of ``role`` (a synchronous redis client)."""
    return parse_marks(client.hgetall(keys.draining(role)))


def mark_value(worker: WorkerInfo, now: float) -> str:
    """What a drain stores: the run's start time, exactly (repr round-trips a float), and when."""
    return f"{worker.started_at!r} {now!r}"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
