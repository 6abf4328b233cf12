"""The decode pool as one request sees it: admit, submit, abort, release, is_alive.

``Dispatcher`` is the narrow interface a ``Generation`` (and its failover)
talks to; it holds the router, the admission queue and the gateway's output
stream name, and runs aborts and releases as background tasks so that a
cancelled request still sends them.

Liveness: a decode worker is taken for lost once its registry record is gone (or
names another run of it) and its last heartbeat the gateway saw is older than the
heartbeat TTL (its record's own, else this gateway's). A record that vanished sooner was wiped with Redis's data (a
restart without persistence): the worker re-registers within a heartbeat
interval, and its requests wait for it instead of being recomputed elsewhere.

Failover: a request whose decode worker was lost waits up to
``--failover-wait-s`` (and never past its own deadline) for a decode worker to be
alive again, so with one decode worker its restarted self takes the request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from tandem.cluster.messages import GenerateRequest, WorkerInfo
from tandem.gateway.admission_queue import AdmissionQueue
from tandem.gateway.background import BackgroundTasks
from tandem.gateway.errors import NoWorkerAvailable
from tandem.gateway.router import PromptPrefix, Router
from tandem.gateway.validation import GenerationInput

ABORT_RETRY_S = 60.0  # how long an abort is retried through a Redis outage
FAILOVER_POLL_S = 0.25


@dataclass
class _Seen:
    started_at: float
    heartbeat_at: float  # the worker's own clock (wall time), as its record says
    ttl_s: float  # how long its record lives without a beat


class Dispatcher:
    def __init__(self, router: Router, admission: AdmissionQueue, reply_to: str, background: BackgroundTasks,
                 heartbeat_ttl_s: float = 5.0, failover_wait_s: float = 60.0):
        self._router = router
        self._admission = admission
        self._reply_to = reply_to  # the gateway's output stream, where the workers send this request's tokens
        self._background = background
        self._heartbeat_ttl_s = heartbeat_ttl_s
        self._failover_wait_s = failover_wait_s
        self._seen: dict[str, _Seen] = {}  # decode worker id -> its run and last heartbeat seen

    async def admit(self, wire_id: str, num_prompt_tokens: int, max_tokens: int, priority: int = 0, *,
                    resumed: bool = False, deadline: float | None = None,
                    client_left: asyncio.Event | None = None,
                    prompt: PromptPrefix | None = None) -> WorkerInfo:
        """Reserve room on a decode worker (waiting in the admission queue while none has it).
        A new request needs a live prefill worker too (or a decode worker that computes its own
        prompts): without one it gets 503 at once, as without a decode worker. A resumed one waits for a decode worker (``failover_wait_s``)."""
        if not resumed:
            if not await self._router.workers("prefill") and not any(
                    w.computes_prompts for w in await self._router.workers("decode")):
                raise NoWorkerAvailable("no prefill worker is alive; retry later")
            worker = await self._admission.admit(wire_id, num_prompt_tokens, max_tokens, priority,
                                                 deadline=deadline, client_left=client_left, prompt=prompt)
            return self._saw(worker)
        wait_until = time.monotonic() + self._failover_wait_s
        if deadline is not None:
            wait_until = min(wait_until, deadline)
        while True:
            try:
                return self._saw(await self._admission.admit(wire_id, num_prompt_tokens, max_tokens, priority,
                                                             resumed=True, deadline=deadline, client_left=client_left))
            except (NoWorkerAvailable, RedisError):
                if time.monotonic() + FAILOVER_POLL_S > wait_until:
                    raise
                await asyncio.sleep(FAILOVER_POLL_S)

    def _saw(self, worker: WorkerInfo) -> WorkerInfo:
        self._seen[worker.worker_id] = _Seen(worker.started_at, worker.heartbeat_at,
                                             worker.heartbeat_ttl_s or self._heartbeat_ttl_s)
        return worker

    async def submit(self, worker: WorkerInfo, wire_id: str, inp: GenerationInput,
                     output_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        """Send the request to the worker that reserved room for it (with its LoRA adapter's name,
        path and digest, on a failover's resubmission too); on failure give the room back."""
        request = GenerateRequest(
            request_id=wire_id,
            prompt_token_ids=inp.prompt_token_ids,
            sampling=inp.sampling,
            max_tokens=inp.max_tokens,
            stop_token_ids=inp.stop_token_ids,
            ignore_eos=inp.ignore_eos,
            priority=inp.priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            reply_to=self._reply_to,
            output_token_ids=list(output_token_ids or []),
            lora_name=inp.lora_name,
            lora_path=inp.lora_path,
            lora_digest=inp.lora_digest,
        )
        try:
            await self._router.submit(worker, request)
        except BaseException:
            # it never reached the worker: give its room back (if this fails too, the worker's reconcile does)
            self.release(worker.worker_id, wire_id)
            raise

    def abort(self, worker_id: str, wire_id: str, reason: str) -> None:
        """Tell the worker to stop the request (in the background, retried through a Redis outage)."""
        self._background.spawn(self.send_abort(worker_id, wire_id, reason))

    def release(self, worker_id: str, wire_id: str) -> None:
        """Give back the room the request holds on the worker (in the background)."""
        self._background.spawn(self._router.release(worker_id, wire_id))

    async def is_alive(self, worker_id: str, started_at: float | None) -> bool:
        """Whether that run of the decode worker still heartbeats (see the module's docstring). A
        Redis error says nothing about it (the worker keeps its events in its outbox through an
        outage): True then, and the request's deadline bounds the wait."""
        try:
            workers = await self._router.workers("decode")
        except RedisError:
            return True
        record = next((w for w in workers if w.worker_id == worker_id), None)
        if record is not None:
            self._saw(record)
            return started_at is None or record.started_at == started_at  # another run lost its requests
        seen = self._seen.get(worker_id)
        if seen is None or (started_at is not None and seen.started_at != started_at):
            return False
        # gone before its key could expire: Redis lost its data; the worker re-registers soon
        return time.time() - seen.heartbeat_at < seen.ttl_s

    async def send_abort(self, worker_id: str, wire_id: str, reason: str) -> None:
        """The abort itself, retried for up to ABORT_RETRY_S: until the worker reads it, it
        generates on and holds the request's blocks."""
        deadline, delay = time.monotonic() + ABORT_RETRY_S, 0.05
        while True:
            try:
                await self._router.abort(worker_id, wire_id, reason)
                return
            except RedisError:
                if time.monotonic() + delay > deadline:
                    raise  # logged by the background task's done-callback
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
