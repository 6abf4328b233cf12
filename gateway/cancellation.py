"""A client that goes away cancels its request on the workers.

Streaming: Starlette cancels the body iterator when the client disconnects;
the generation's ``finally`` sends the abort. ``GenerationStreamResponse``
also closes the generation when the response ends without ever starting the
iterator (a disconnect before the first byte).

Non-streaming: ``until_disconnected`` runs the work next to a task that waits
for ``http.disconnect`` (like vLLM's ``with_cancellation``) and cancels the
work when the client leaves first.

Before either, while a request is admitted (and waits in the admission queue),
``watching_disconnect`` awaits its ``http.disconnect`` and sets an event the
queue wakes on: a client that left gives up its place (and is never
submitted), so it holds no room in the queue that live clients would be
refused for, and a waiting request costs nothing until then (no polling).

Resumable streams (``stream_options.resumable``) are the exception once
submitted: their response only follows the events retained in Redis
(``tandem.gateway.resume``), so a disconnect ends that following and nothing
else; the request runs on for a client that comes back with its Last-Event-ID.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.gateway.errors import ClientDisconnected
from tandem.gateway.choices import Choices

T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientDisconnected("client disconnected")


@asynccontextmanager
async def watching_disconnect(request: Request) -> AsyncIterator[asyncio.Event]:
    """An event set once the client goes away, while the block runs. The request's body has
    been read, so the next ASGI message is its ``http.disconnect``: awaited, not polled. The
    watch ends with the block, before a response starts (which listens on its own)."""
    left = asyncio.Event()

    async def watch() -> None:
        await _wait_for_disconnect(request)
        left.set()

    task = asyncio.ensure_future(watch())
    try:
        yield left
    finally:
        task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GenerationStreamResponse(StreamingResponse):
    """SSE response that closes ``generation`` (a request's Choices) whatever happens to the stream."""

    def __init__(self, content, generation: Choices):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Request-Id": generation.request_id})
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()


def followed_stream_response(events: AsyncIterator[bytes] | None, request_id: str) -> Response:
    """A resumable stream's response: its retained events; closing it leaves the request alone.
    None (the client already has the stream's last event) is a 204, which tells an EventSource
    to stop reconnecting."""
    if events is None:
        return Response(status_code=204, headers={"X-Request-Id": request_id})
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
