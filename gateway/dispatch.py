"""The decode pool as one request sees it: admit, submit, abort, release, is_alive.

``Dispatcher`` is the narrow interface a ``Generation`` (and its failover)
talks to; it holds the router, the admission queue and the gateway's output
stream name, and runs aborts and releases as background tasks so that a
cancelled request still sends them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from tandem.cluster.messages import GenerateRequest, WorkerInfo
from tandem.gateway.admission import AdmissionQueue
from tandem.gateway.background import BackgroundTasks
from tandem.gateway.router import Router
from tandem.gateway.validation import GenerationInput

ABORT_RETRY_S = 60.0  # how long an abort is retried through a Redis outage


class Dispatcher:
    def __init__(self, router: Router, admission: AdmissionQueue, reply_to: str, background: BackgroundTasks):
        self._router = router
        self._admission = admission
        self._reply_to = reply_to  # the gateway's output stream, where the workers send this request's tokens
        self._background = background

    async def admit(self, wire_id: str, num_prompt_tokens: int, max_tokens: int, priority: int = 0, *,
                    resumed: bool = False, deadline: float | None = None,
                    client_gone: Callable[[], Awaitable[bool]] | None = None) -> WorkerInfo:
        """Reserve room on a decode worker (waiting in the admission queue while none has it)."""
        return await self._admission.admit(wire_id, num_prompt_tokens, max_tokens, priority, resumed=resumed,
                                           deadline=deadline, client_gone=client_gone)

    async def submit(self, worker: WorkerInfo, wire_id: str, inp: GenerationInput,
                     output_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None:
        """Send the request to the worker that reserved room for it; on failure give the room back."""
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
        """Whether that run of the decode worker still heartbeats. A Redis error says nothing about
        it (the worker keeps its events in its outbox through an outage): True then, and the
        request's deadline bounds the wait."""
        try:
            return await self._router.is_alive("decode", worker_id, started_at)
        except RedisError:
            return True

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
