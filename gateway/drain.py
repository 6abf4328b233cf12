"""A gateway's way down: serving, then draining, then stopping.

    SERVING --SIGTERM--> DRAINING --open requests done, or --shutdown-timeout-s--> (exit)
                            |--second signal--> STOPPING: every open stream ends now with an
                                                error event and [DONE] (its workers are told)

``DrainMiddleware`` counts the /v1 requests in flight (a streaming response counts
until its last byte) and, once draining, answers new ones with 503
``shutting_down`` and Retry-After, so a load balancer or client retries on
another gateway; /health says 503 too (``Drain.draining``). The open streams are
ended by ``OutputMux.fail_all``, which hands every request's queue the error.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.gateway.errors import ShuttingDown, error_response


class DrainState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"


class Drain:
    def __init__(self) -> None:
        self.state = DrainState.SERVING
        self.num_in_flight = 0
        self._listeners: list[Callable[[], None]] = []

    @property
    def draining(self) -> bool:
        return self.state is not DrainState.SERVING

    def on_drain(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` when draining starts (the gRPC health service goes NOT_SERVING)."""
        self._listeners.append(listener)

    def start(self) -> None:
        if self.state is DrainState.SERVING:
            self.state = DrainState.DRAINING
            for listener in self._listeners:
                listener()

    def stop_now(self) -> None:
        self.start()
        self.state = DrainState.STOPPING

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Until no /v1 request is in flight (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline and self.state is DrainState.DRAINING:
            await asyncio.sleep(poll_s)
        return self.num_in_flight == 0


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await error_response(ShuttingDown("the gateway is shutting down; retry on another"))(scope, receive, send)
            return
        self.drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_in_flight -= 1
