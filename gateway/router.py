"""Routing: which decode worker gets a request, and the messages sent to it.

The registry (``tandem:worker:<role>:*``, one key per live worker, TTL =
heartbeat) is read at most every ``CACHE_TTL_S`` per role and shared by all
requests; concurrent readers wait for one refresh. Between refreshes the
gateway charges each submission to the worker it chose (blocks for prompt +
max_tokens, one waiting request), so a burst of requests spreads over the
pool instead of all landing on the worker that looked emptiest at the last
refresh. The snapshot itself stays as the workers reported it (metrics
republish it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import redis.asyncio as aioredis
import structlog

from cluster import keys
from cluster.messages import FIELD, AbortRequest, GenerateRequest, MessageError, WorkerInfo, decode, encode
from gateway.errors import NoWorkerAvailable

log = structlog.get_logger(__name__)

CACHE_TTL_S = 0.25
ROLES = ("decode", "prefill")


async def live_workers(client: aioredis.Redis, role: str) -> list[WorkerInfo]:
    """Every worker of ``role`` whose heartbeat has not expired (async ``cluster.registry.live_workers``)."""
    names = [name async for name in client.scan_iter(match=keys.worker_pattern(role), count=1000)]
    if not names:
        return []
    workers = []
    for raw in await client.mget(names):
        if raw is None:
            continue  # expired between SCAN and MGET
        try:
            workers.append(decode(raw))
        except MessageError as exc:
            log.error("unreadable registry record", role=role, error=str(exc))
    return workers


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // max(block_size, 1))


def choose_decode_worker(workers: list[WorkerInfo], num_tokens: int) -> WorkerInfo | None:
    """The worker with the most room that can hold ``num_tokens``; else the least loaded (it will queue)."""
    if not workers:
        return None
    fits = [w for w in workers if w.num_free_blocks * w.block_size >= num_tokens]
    if fits:
        return max(fits, key=lambda w: (w.num_free_blocks * w.block_size, -_load(w), w.worker_id))
    return min(workers, key=lambda w: (_load(w), -w.num_free_blocks, w.worker_id))


def _load(worker: WorkerInfo) -> int:
    return worker.num_running + worker.num_waiting


class Router:
    def __init__(self, client: aioredis.Redis, cache_ttl_s: float = CACHE_TTL_S):
        self._client = client
        self._cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, list[WorkerInfo]]] = {}
        self._locks = {role: asyncio.Lock() for role in ROLES}
        # worker_id -> (blocks, requests) submitted since the last decode snapshot
        self._charges: dict[str, tuple[int, int]] = {}

    async def workers(self, role: str, max_age_s: float | None = None) -> list[WorkerInfo]:
        """Live workers of ``role``, at most ``max_age_s`` (default: the cache TTL) old."""
        max_age_s = self._cache_ttl_s if max_age_s is None else max_age_s
        if self._is_fresh(role, max_age_s):
            return self._cache[role][1]
        async with self._locks[role]:
            if not self._is_fresh(role, max_age_s):  # someone else may have refreshed meanwhile
                self._cache[role] = (time.monotonic(), await live_workers(self._client, role))
                if role == "decode":
                    self._charges.clear()
        return self._cache[role][1]

    def cached(self, role: str) -> list[WorkerInfo]:
        """The last snapshot, whatever its age (for metrics)."""
        return self._cache.get(role, (0.0, []))[1]

    async def is_alive(self, role: str, worker_id: str, started_at: float | None = None) -> bool:
        """Whether the worker heartbeats; with ``started_at``, the same incarnation of it
        (a worker restarted under the same id has lost the requests it held)."""
        return any(w.worker_id == worker_id and started_at in (None, w.started_at) for w in await self.workers(role))

    async def pick_decode_worker(self, num_tokens: int) -> WorkerInfo:
        worker = choose_decode_worker([self._charged(w) for w in await self.workers("decode")], num_tokens)
        if worker is None:
            raise NoWorkerAvailable("no decode worker is alive; retry later")
        return worker

    async def submit(self, worker: WorkerInfo, request: GenerateRequest) -> None:
        await self._client.xadd(keys.inbox("decode", worker.worker_id), {FIELD: encode(request)})
        # charged until the next snapshot shows the worker's own numbers
        blocks = blocks_needed(len(request.prompt_token_ids) + request.max_tokens, worker.block_size)
        charged_blocks, charged_requests = self._charges.get(worker.worker_id, (0, 0))
        self._charges[worker.worker_id] = (charged_blocks + blocks, charged_requests + 1)

    async def abort(self, worker_id: str, request_id: str, reason: str) -> None:
        await self._client.xadd(keys.inbox("decode", worker_id), {FIELD: encode(AbortRequest(request_id, reason))})

    def _charged(self, worker: WorkerInfo) -> WorkerInfo:
        blocks, requests = self._charges.get(worker.worker_id, (0, 0))
        if not requests:
            return worker
        return dataclasses.replace(worker, num_free_blocks=max(worker.num_free_blocks - blocks, 0),
                                   num_waiting=worker.num_waiting + requests)

    def _is_fresh(self, role: str, max_age_s: float) -> bool:
        entry = self._cache.get(role)
        return entry is not None and time.monotonic() - entry[0] <= max_age_s
