"""Draining: workers that get no new requests while they finish what they hold.

The admin API (``gateway.admin``) marks a worker in ``keys.draining(role)``, a hash
worker_id -> the ``started_at`` of the incarnation it drains. Routers skip a marked
worker: the gateways when they admit a request to a decode worker (``gateway.router``),
the decode workers when they hand a prefill job out (``decode.worker``). The mark names
one incarnation, so a worker restarted under its id (compose and ``tandem serve`` use
fixed ids) takes work again without an undrain; marks of incarnations that are gone are
pruned at the next drain. Torch-free.
"""

from __future__ import annotations

from cluster import keys
from cluster.messages import WorkerInfo


def parse_marks(raw: dict) -> dict[str, float]:
    """HGETALL of ``keys.draining(role)`` -> worker_id -> started_at (unreadable fields skipped)."""
    marks = {}
    for worker_id, started_at in raw.items():
        try:
            marks[_text(worker_id)] = float(_text(started_at))
        except ValueError:
            continue
    return marks


def is_draining(worker: WorkerInfo, marks: dict[str, float]) -> bool:
    return marks.get(worker.worker_id) == worker.started_at


def accepting(workers: list[WorkerInfo], marks: dict[str, float]) -> list[WorkerInfo]:
    """The workers that take new requests."""
    return [w for w in workers if not is_draining(w, marks)]


def read_marks(client, role: str) -> dict[str, float]:
    """The drain marks of ``role`` (a synchronous redis client)."""
    return parse_marks(client.hgetall(keys.draining(role)))


def mark_value(worker: WorkerInfo) -> str:
    """What a drain stores: the incarnation's start time, exactly (repr round-trips a float)."""
    return repr(worker.started_at)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
