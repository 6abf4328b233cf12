"""What the prefill and decode worker processes share: the step loop, its start and end, and
the registry record."""

from __future__ import annotations

import os
import threading
from typing import Callable

import redis
import structlog

from tandem.cluster import keys
from tandem.cluster.messages import WorkerInfo
from tandem.cluster.process import pid_namespace, sleep_unless_stopped
from tandem.cluster.settings import Settings

log = structlog.get_logger(__name__)

REDIS_RETRY_S = 0.5


def run_steps(step: Callable[[], None], stop: threading.Event) -> None:
    """Call ``step`` until ``stop`` is set; a Redis outage is waited out, not fatal."""
    while not stop.is_set():
        try:
            step()
        except redis.RedisError as exc:
            log.warning("redis unavailable, retrying", error=str(exc))
            sleep_unless_stopped(stop, REDIS_RETRY_S)  # not stop.wait(): see cluster.process


def serve_steps(worker, stop: threading.Event) -> None:
    """A warmed-up worker's life: heartbeats, then ``worker.step`` until ``stop``, then what it
    holds let go (its adapter loader, its prefix index's registry entry, its process group and
    its KV pool, whose file a split model shares)."""
    worker.heartbeat.start()
    try:
        run_steps(worker.step, stop)
    finally:
        worker.heartbeat.stop()
        worker.lora_loads.close()
        if worker.prefix_index is not None:
            worker.prefix_index.delete()
        worker.runner.leave_group()
        worker.runner.kv_pool.close()


def worker_info(
    settings: Settings, role: str, worker_id: str, inbox: str, started_at: float, **load
) -> WorkerInfo:
    """A registry record: identity from the arguments, load and role-specific fields from ``load``."""
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        model=settings.model_name,
        inbox=inbox,
        pid=os.getpid(),
        pid_namespace=pid_namespace(),
        host=os.uname().nodename,
        started_at=started_at,
        heartbeat_at=0.0,
        block_size=settings.tokens_per_block,
        max_seq_len=settings.max_seq_len,
        num_restarts=max(settings.restarts, 0),  # --restarts, which tandem serve's supervisor sets
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        liveness_channel=keys.liveness(role, worker_id, started_at),
        **load,
    )
