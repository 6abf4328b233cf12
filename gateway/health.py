"""The standard gRPC health service (``grpc.health.v1.Health``) on the admin port.

Services and when each is SERVING (NOT_SERVING otherwise, and all of them once the
gateway drains):

    ""                        the gateway can serve: Redis answers and both pools have a
                              live worker of its model
    "tandem.admin.v1.Admin"   the admin API can answer: Redis answers
    "prefill", "decode"       that pool has a live worker of the gateway's model

``GatewayHealth.start`` sets every service NOT_SERVING, then re-reads the registry
through the gateway's ``Router`` every ``interval_s`` (1 s). ``set_draining`` is a plain
call (safe from a signal handler or another thread) that turns everything NOT_SERVING for
good and tells watchers at once.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from tandem.gateway.router import ROLES, Router

log = structlog.get_logger(__name__)

ADMIN_SERVICE = "tandem.admin.v1.Admin"
OVERALL = ""
SERVICES = (OVERALL, ADMIN_SERVICE, *ROLES)
INTERVAL_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def statuses(counts: dict[str, int] | None, draining: bool) -> dict[str, int]:
    """Each service's status from the live workers per role (None: Redis did not answer)."""
    if draining or counts is None:
        return dict.fromkeys(SERVICES, NOT_SERVING)
    pools = {role: SERVING if counts.get(role, 0) > 0 else NOT_SERVING for role in ROLES}
    overall = SERVING if all(status == SERVING for status in pools.values()) else NOT_SERVING
    return {OVERALL: overall, ADMIN_SERVICE: SERVING, **pools}


class GatewayHealth:
    def __init__(self, router: Router, interval_s: float = INTERVAL_S):
        self.servicer = health_aio.HealthServicer()
        self._router = router
        self._interval_s = interval_s
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._last: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    @property
    def draining(self) -> bool:
        return self._draining

    def set_draining(self) -> None:
        """From now on every service is NOT_SERVING (a load balancer stops sending here).
        Only sets a flag and wakes the refresh loop, so any thread or a signal handler may call it."""
        self._draining = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def refresh(self) -> None:
        counts: dict[str, int] | None
        try:
            # bounded: a Redis that accepts but never answers must not freeze the statuses
            counts = {role: len(await asyncio.wait_for(self._router.workers(role), 2 * self._interval_s))
                      for role in ROLES}
        except Exception as exc:  # any Redis failure: NOT_SERVING, whatever its type
            if self._last.get(ADMIN_SERVICE) != NOT_SERVING:
                log.warning("health: the registry cannot be read", error=str(exc))
            counts = None
        current = statuses(counts, self._draining)
        for service, status in current.items():
            if self._last.get(service) != status:
                await self.servicer.set(service, status)
        self._last = current

    async def start(self) -> None:
        """Every service NOT_SERVING until the first read of the registry (no I/O here, so the
        server can start at once), then the refresh loop until ``stop``."""
        for service in SERVICES:
            await self.servicer.set(service, NOT_SERVING)
        self._last = dict.fromkeys(SERVICES, NOT_SERVING)
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            await self.refresh()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
