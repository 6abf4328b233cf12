"""Reject request bodies over a size limit with an OpenAI-shaped 413.

A declared ``Content-Length`` over the limit is answered before the app runs;
a chunked body is counted as it is read and, once over, an ``HTTPException``
(413) is raised from ``receive`` so it reaches the app's error handlers
(FastAPI re-raises HTTPExceptions that come out of body reading). Starlette's
own limiter is not used because it answers with plain text.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.gateway.errors import error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = HTTPException(413, f"request body exceeds {self.max_body_bytes} bytes")
        if _content_length(scope) > self.max_body_bytes:
            await error_response(too_large)(scope, receive, send)
            return
        num_bytes = 0

        async def receive_with_limit() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise too_large
            return message

        await self.app(scope, receive_with_limit, send)


def _content_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
