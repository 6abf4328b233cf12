"""The gateway's registry snapshot: concurrent callers share one read and wake together."""

from __future__ import annotations

import asyncio

import pytest

from tandem.cluster.messages import WorkerInfo, encode
from tandem.gateway.router import Router


class _Registry:
    """Just enough of redis.asyncio for ``live_workers``: SCAN then MGET, each taking a while
    (and HGETALL of the drain marks)."""

    def __init__(self, fail: bool = False):
        self.reads, self.fail = 0, fail
        record = WorkerInfo(worker_id="decode-0", role="decode", model="m", inbox="i", pid=1, host="h",
                            started_at=1.0, heartbeat_at=1.0, num_total_blocks=8, num_free_blocks=8)
        self.value = encode(record)

    def register_script(self, _source):
        return None

    async def scan_iter(self, match, count):
        self.reads += 1
        await asyncio.sleep(0.01)
        if self.fail:
            raise ConnectionError("redis is down")
        yield b"tandem:worker:decode:decode-0"

    async def mget(self, names):
        await asyncio.sleep(0.001)
        return [self.value for _ in names]

    async def hgetall(self, _key):  # the decode workers' drain marks, read with the registry
        return {}


async def _ticker(ticks: list[int]) -> None:
    while True:  # counts event-loop turns
        ticks[0] += 1
        await asyncio.sleep(0)


def test_callers_waiting_for_a_refresh_share_one_read_and_return_in_the_same_loop_turn():
    async def main():
        registry = _Registry()
        router = Router(registry, cache_ttl_s=60.0)
        ticks = [0]
        ticker = asyncio.ensure_future(_ticker(ticks))
        returned_at = []

        async def caller():
            workers = await router.workers("decode")
            returned_at.append(ticks[0])
            return workers

        results = await asyncio.gather(*(caller() for _ in range(16)))
        ticker.cancel()
        return registry.reads, results, returned_at

    reads, results, returned_at = asyncio.run(main())
    assert reads == 1
    assert all([w.worker_id for w in r] == ["decode-0"] for r in results)
    # with a lock, the fresh snapshot went from waiter to waiter one loop turn each (16 turns)
    assert max(returned_at) - min(returned_at) <= 1


def test_a_failed_read_fails_every_waiter_and_the_next_call_reads_again():
    async def main():
        registry = _Registry(fail=True)
        router = Router(registry, cache_ttl_s=60.0)
        outcomes = await asyncio.gather(*(router.workers("decode") for _ in range(4)), return_exceptions=True)
        registry.fail = False
        after = await router.workers("decode")
        return registry.reads, outcomes, after

    reads, outcomes, after = asyncio.run(main())
    assert all(isinstance(o, ConnectionError) for o in outcomes)
    assert reads == 2 and [w.worker_id for w in after] == ["decode-0"]


def test_a_caller_that_goes_away_does_not_cancel_the_read_of_the_others():
    async def main():
        registry = _Registry()
        router = Router(registry, cache_ttl_s=60.0)
        leaving = asyncio.ensure_future(router.workers("decode"))
        staying = asyncio.ensure_future(router.workers("decode"))
        await asyncio.sleep(0.002)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        return registry.reads, await staying

    reads, workers = asyncio.run(main())
    assert reads == 1 and [w.worker_id for w in workers] == ["decode-0"]
