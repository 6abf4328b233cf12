"""Background tasks that must outlive the request that started them (aborts, releases)."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine

import structlog

log = structlog.get_logger(__name__)


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` to completion even if the request that started it is cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background redis call failed", error=str(task.exception()))

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
