"""The gateway's output stream, read once and fanned out to its requests.

Every request this gateway submits names ``keys.gateway_output(gateway_id)``
as its ``reply_to``; workers append one TokenBatch per step there. A single
reader task follows the stream from its first entry (the id is new with each
gateway process) with blocking XREAD and puts each TokenEvent on the queue of
its request.
A request registers its queue before it is submitted, so no event can be
missed, and unregisters when it ends; events for requests no longer
registered (late tokens after an abort) are dropped.

Redis errors do not end the reader: it retries with backoff, and the requests
waiting meanwhile rely on their own deadlines and worker-liveness checks.
"""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis
import structlog

from tandem.cluster import keys
from tandem.cluster.messages import FIELD, TokenBatch, TokenEvent, decode

log = structlog.get_logger(__name__)

READ_BLOCK_MS = 1000
READ_COUNT = 1024
RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class OutputMux:
    def __init__(self, client: aioredis.Redis, gateway_id: str | None = None):
        self._client = client
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.stream = keys.gateway_output(self.gateway_id)
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._task: asyncio.Task | None = None

    def register(self, request_id: str) -> asyncio.Queue[TokenEvent]:
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def fail_all(self, error: Exception) -> None:
        """End every registered request with ``error`` (the gateway is stopping now): each reader
        raises it, so its stream ends with an error event and its workers are told to abort."""
        for queue in self._queues.values():
            queue.put_nowait(error)

    @property
    def num_registered(self) -> int:
        return len(self._queues)

    def start(self) -> None:
        """Start the reader (idempotent; needs a running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="output-mux")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        try:
            await self._client.delete(self.stream)
        except Exception:  # Redis may be gone; the stream is trimmed and harmless
            pass

    async def _run(self) -> None:
        last_id = "0-0"
        failures = 0
        while True:
            try:
                reply = await self._client.xread({self.stream: last_id}, block=READ_BLOCK_MS, count=READ_COUNT)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep reading whatever Redis does; requests have their own deadlines
                delay = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                log.warning("output stream read failed, retrying", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    self._dispatch(entry_id, fields)

    def _dispatch(self, entry_id, fields) -> None:
        try:
            msg = decode(fields[FIELD])
            events = msg.unpack() if isinstance(msg, TokenBatch) else [msg]
            routed = [(self._queues.get(event.request_id), event) for event in events]
        except Exception as exc:  # MessageError, or a well-formed message with ill-typed fields
            log.error("dropping unreadable output entry", entry_id=entry_id, error=str(exc))
            return
        for queue, event in routed:
            if queue is not None:
                queue.put_nowait(event)
