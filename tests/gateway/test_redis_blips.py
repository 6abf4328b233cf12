"""A short Redis outage as the gateway sees it: a stream whose liveness check meets a Redis
error keeps waiting (it is not failed as if its worker were lost), and an abort is retried
until Redis is back."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tandem.gateway import dispatch as dispatch_module
from tandem.gateway.background import BackgroundTasks
from tandem.gateway.dispatch import Dispatcher


class _FlakyRouter:
    def __init__(self, failures: int):
        self.failures, self.aborts, self.calls = failures, [], 0

    async def abort(self, worker_id, wire_id, reason):
        self.calls += 1
        if self.calls <= self.failures:
            raise RedisConnectionError("redis is down")
        self.aborts.append((worker_id, wire_id, reason))

    async def workers(self, role, max_age_s=None):
        raise RedisConnectionError("redis is down")


def _dispatcher(router) -> Dispatcher:
    return Dispatcher(router, admission=None, reply_to="out", background=BackgroundTasks())


def test_an_abort_is_retried_through_an_outage():
    router = _FlakyRouter(failures=3)
    asyncio.run(_dispatcher(router).send_abort("d0", "cmpl-1", "client disconnected"))
    assert router.calls == 4 and router.aborts == [("d0", "cmpl-1", "client disconnected")]


def test_an_abort_gives_up_after_abort_retry_s(monkeypatch):
    monkeypatch.setattr(dispatch_module, "ABORT_RETRY_S", 0.2)
    router = _FlakyRouter(failures=10**6)
    with pytest.raises(RedisConnectionError):
        asyncio.run(_dispatcher(router).send_abort("d0", "cmpl-1", "x"))
    assert 2 <= router.calls < 10 and router.aborts == []


def test_a_redis_error_in_the_liveness_check_is_not_a_lost_worker():
    assert asyncio.run(_dispatcher(_FlakyRouter(failures=0)).is_alive("d0", 1.0)) is True
