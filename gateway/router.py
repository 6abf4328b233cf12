"""Routing: which decode worker gets a request, and the messages sent to it.

The registry (``tandem:worker:<role>:*``, one key per live worker, TTL =
heartbeat) is read at most every ``CACHE_TTL_S`` per role and shared by all
requests; concurrent readers share one read and wake together. The snapshot stays as the
workers reported it (metrics republish it).

A request goes to a decode worker only with an admission reservation on it
(``tandem.cluster.admission``): one Lua call over every live decode worker picks the
one with the most unreserved room that can take the request under the
capacity policy it reports, and records the charge, atomically, so gateways
sharing a pool cannot oversubscribe a worker. The worker gives the
reservation back when the request leaves it. Workers being drained
(``tandem.cluster.draining``, read with the registry) get no new requests.

Prefix-aware admission (``--enable-prefix-caching``, workers that compute their own prompts:
``--pools colocated``): the workers are tried in order of the longest prefix of the prompt
each has cached (``tandem.cluster.prefix_index``: one pipelined SMISMEMBER per worker), then
by room, so the turns of a conversation go back to the worker holding its history.
"""

from __future__ import annotations

import asyncio
import functools
import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from tandem.cluster import keys
from tandem.cluster.admission import RELEASE_LUA, RESERVE_LUA
from tandem.cluster.block_hashes import block_hashes, num_reusable_blocks
from tandem.cluster.policies import CAPACITY_POLICIES, GUARANTEED_NO_EVICT
from tandem.cluster.draining import accepting, is_draining, parse_marks
from tandem.cluster.messages import FIELD, AbortRequest, GenerateRequest, WorkerInfo, encode
from tandem.cluster.prefix_index import prefix_scores, queue_prefix_queries
from tandem.cluster.registry import of_model, parse_records
from tandem.gateway.errors import NoWorkerAvailable

log = structlog.get_logger(__name__)

CACHE_TTL_S = 0.25
PREFIX_SCORES_TTL_S = 0.25  # how long a queued prompt's prefix lookup stands
ROLES = ("decode", "prefill")


async def live_workers(client: aioredis.Redis, role: str) -> list[WorkerInfo]:
    """Every worker of ``role`` whose heartbeat has not expired (async ``tandem.cluster.registry.live_workers``)."""
    names = [name async for name in client.scan_iter(match=keys.worker_pattern(role), count=1000)]
    return parse_records(role, await client.mget(names), names) if names else []  # bad records skipped


def capacity_tokens(worker: WorkerInfo) -> int:
    """Tokens of admission a decode worker offers: its whole KV pool."""
    return worker.num_total_blocks * worker.block_size


def admission_args(worker: WorkerInfo, num_prompt_tokens: int, max_tokens: int) -> list[int]:
    """(charge, capacity tokens, max requests) of one worker, as RESERVE_LUA reads them."""
    capacity = capacity_tokens(worker)
    # a record naming a policy this gateway does not know is charged by the reserving rule (the larger charge)
    policy = CAPACITY_POLICIES.get(worker.capacity_scheduler_policy) or CAPACITY_POLICIES[GUARANTEED_NO_EVICT]
    charge = policy.charge_tokens(
        num_prompt_tokens, max_tokens, worker.max_seq_len, worker.block_size, capacity)
    return [charge, capacity, worker.max_admitted or worker.max_batch_size]


class PromptPrefix:
    """A prompt as prefix-aware admission looks it up: its token ids and what else its KV depends
    on (its LoRA adapter's digest). The hashes of its reusable blocks are made once per block
    size, and its workers' scores are kept ``PREFIX_SCORES_TTL_S`` (the head of the admission
    queue asks again every poll)."""

    __slots__ = ("token_ids", "salt", "_hashes", "_scores")

    def __init__(self, token_ids: list[int], salt: str = ""):
        self.token_ids, self.salt = token_ids, salt
        self._hashes: tuple[int, list[bytes]] | None = None
        self._scores: tuple[float, tuple[str, ...], dict[str, float]] | None = None

    def hashes(self, block_size: int) -> list[bytes]:
        if self._hashes is None or self._hashes[0] != block_size:
            end = num_reusable_blocks(len(self.token_ids), block_size) * block_size
            self._hashes = (block_size, block_hashes(self.token_ids[:end], block_size, salt=self.salt))
        return self._hashes[1]

    def kept_scores(self, worker_ids: tuple[str, ...], now: float) -> dict[str, float] | None:
        """The scores of these workers looked up less than ``PREFIX_SCORES_TTL_S`` ago, if any."""
        if self._scores is not None and self._scores[1] == worker_ids and now - self._scores[0] < PREFIX_SCORES_TTL_S:
            return self._scores[2]
        return None

    def keep_scores(self, worker_ids: tuple[str, ...], now: float, scores: dict[str, float]) -> None:
        self._scores = (now, worker_ids, scores)


def tie_order(workers: list[WorkerInfo]) -> list[WorkerInfo]:
    """Candidates in the order that breaks ties of room: most free blocks, then least loaded."""
    return sorted(workers, key=lambda w: (-w.num_free_blocks, w.num_running + w.num_waiting, w.worker_id))


class Router:
    """``model``: only workers serving it count (workers of other models sharing the Redis are
    another cluster's); None: every worker."""

    def __init__(self, client: aioredis.Redis, cache_ttl_s: float = CACHE_TTL_S, model: str | None = None,
                 prefix_routing: bool = False):
        """``prefix_routing``: a request goes first to the worker (of those computing their own
        prompts) holding the longest prefix of its prompt (``tandem.cluster.prefix_index``)."""
        self._client = client
        self._prefix_routing = prefix_routing
        self._model = model
        self._foreign: set[tuple[str, str]] = set()  # (role, id) of workers of other models, logged once
        self._cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, list[WorkerInfo]]] = {}
        self._drain_marks: dict = {}  # decode worker id -> cluster.draining.Mark, read with the registry
        self._refreshing: dict[str, asyncio.Future] = {}  # role -> the registry read in flight
        self._reserve = client.register_script(RESERVE_LUA)
        self._release = client.register_script(RELEASE_LUA)

    async def workers(self, role: str, max_age_s: float | None = None) -> list[WorkerInfo]:
        """Live workers of ``role``, at most ``max_age_s`` (default: the cache TTL) old."""
        max_age_s = self._cache_ttl_s if max_age_s is None else max_age_s
        if self._is_fresh(role, max_age_s):
            return self._cache[role][1]
        refresh = self._refreshing.get(role)
        if refresh is None:
            refresh = asyncio.ensure_future(self._refresh(role))
            self._refreshing[role] = refresh
            refresh.add_done_callback(functools.partial(self._refreshed, role))
        # every caller awaits the same read and all wake together (a lock would hand the fresh
        # snapshot from waiter to waiter, one event-loop turn each, while later arrivals overtake
        # them); shielded: a caller that goes away does not cancel the others' read
        return await asyncio.shield(refresh)

    async def _refresh(self, role: str) -> list[WorkerInfo]:
        started = time.monotonic()
        workers = await live_workers(self._client, role)
        if self._model is not None:
            workers = of_model(workers, self._model, self._foreign)
        if role == "decode":
            self._drain_marks = parse_marks(await self._client.hgetall(keys.draining(role)))
        self._cache[role] = (started, workers)
        return workers

    def _refreshed(self, role: str, refresh: asyncio.Future) -> None:
        self._refreshing.pop(role, None)
        if not refresh.cancelled():
            refresh.exception()  # marked retrieved: each waiter raises it too

    def cached(self, role: str) -> list[WorkerInfo]:
        """The last snapshot, whatever its age (for metrics)."""
        return self._cache.get(role, (0.0, []))[1]

    async def is_alive(self, role: str, worker_id: str, started_at: float | None = None) -> bool:
        """Whether the worker heartbeats; with ``started_at``, the same incarnation of it
        (a worker restarted under the same id has lost the requests it held)."""
        return any(w.worker_id == worker_id and started_at in (None, w.started_at) for w in await self.workers(role))

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                      resumed: bool = False, prompt: PromptPrefix | None = None) -> WorkerInfo | None:
        """Admit the request to a decode worker that can take it now (atomically); None if none can.
        A draining worker takes none, except a ``resumed`` request (its worker was lost) that no
        other worker can take: finishing it beats failing it. With prefix routing and ``prompt``,
        the workers holding longer prefixes of it are tried first.

        Raises NoWorkerAvailable when no decode worker is alive, or every one is draining.
        """
        live = await self.workers("decode")
        if not live:
            raise NoWorkerAvailable("no decode worker is alive; retry later")
        marks = self._drain_marks
        taking = accepting(live, marks)
        if not taking and not resumed:
            raise NoWorkerAvailable("every decode worker is being drained; retry later")
        scores = await self._prefix_scores(taking, prompt) if prompt is not None and len(taking) > 1 else None
        worker = await self._reserve_on(taking, request_id, num_prompt_tokens, max_tokens, scores) if taking else None
        if worker is None and resumed:
            draining = [w for w in live if is_draining(w, marks)]
            if draining:
                worker = await self._reserve_on(draining, request_id, num_prompt_tokens, max_tokens)
        return worker

    async def _prefix_scores(self, candidates: list[WorkerInfo], prompt: PromptPrefix) -> dict[str, float] | None:
        """Worker id -> blocks of ``prompt``'s prefix it holds, for the candidates that compute their
        own prompts (None without prefix routing, or when Redis could not say: order by room)."""
        computing = [w for w in candidates if w.computes_prompts]
        if not self._prefix_routing or len(computing) < 2:
            return None
        ids = tuple(w.worker_id for w in computing)
        now = time.monotonic()
        if (kept := prompt.kept_scores(ids, now)) is not None:
            return kept
        hashes = prompt.hashes(computing[0].block_size)
        if not hashes:
            return None
        pipe = self._client.pipeline(transaction=False)
        queue_prefix_queries(pipe, list(ids), hashes)
        try:
            scores = prefix_scores(list(ids), await pipe.execute())
        except RedisError:
            return None  # a hint: the reservation itself tells whether Redis is there
        prompt.keep_scores(ids, now, scores)
        return scores

    async def _reserve_on(self, candidates: list[WorkerInfo], request_id: str, num_prompt_tokens: int,
                          max_tokens: int, scores: dict[str, float] | None = None) -> WorkerInfo | None:
        workers = tie_order(candidates)
        num_preferred = 0
        if scores:  # longest cached prefix first, then by room (a stable sort keeps the tie order)
            workers.sort(key=lambda w: -scores.get(w.worker_id, 0.0))
            num_preferred = sum(1 for w in workers if scores.get(w.worker_id, 0.0) > 0)
        script_keys, args = [], [request_id]
        for worker in workers:
            script_keys += [keys.admitted(worker.worker_id), keys.reserved_tokens(worker.worker_id)]
            args += admission_args(worker, num_prompt_tokens, max_tokens)
        if num_preferred:  # those holding some of the prefix: the first of them with room takes it
            args.append(num_preferred)
        index = int(await self._reserve(keys=script_keys, args=args))
        return workers[index] if index >= 0 else None

    async def load_scripts(self) -> None:
        """Put the admission scripts in Redis's script cache. Without this the first burst of
        requests each get NOSCRIPT and load them again: extra round trips that put the first
        arrivals behind later ones."""
        for script in (self._reserve, self._release):
            await self._client.script_load(script.script)

    async def release(self, worker_id: str, request_id: str) -> None:
        """Give a reservation back (a submission that failed); a no-op if there is none."""
        await self._release(keys=[keys.admitted(worker_id), keys.reserved_tokens(worker_id)], args=[request_id])

    async def submit(self, worker: WorkerInfo, request: GenerateRequest) -> None:
        await self._client.xadd(keys.inbox("decode", worker.worker_id), {FIELD: encode(request)})

    async def abort(self, worker_id: str, request_id: str, reason: str) -> None:
        await self._client.xadd(keys.inbox("decode", worker_id), {FIELD: encode(AbortRequest(request_id, reason))})

    def _is_fresh(self, role: str, max_age_s: float) -> bool:
        entry = self._cache.get(role)
        return entry is not None and time.monotonic() - entry[0] <= max_age_s
