"""The served LoRA adapters in Redis (``tandem.cluster.lora_registry``) against a real
redis-server: a registration is idempotent for the same adapter, a name taken by another path
or other weights is refused and keeps its record, two gateways racing for one name cannot both
win, unregistering returns what it removed, and unreadable records are skipped."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from tandem.cluster import keys
from tandem.cluster.lora_registry import LoraRecord, LoraRegistry, NameTaken, new_record


def run(redis_url: str, body):
    """Run ``body(registry)`` on a fresh asyncio client."""
    async def main():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await body(LoraRegistry(client))
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_register_is_idempotent_and_a_taken_name_is_refused(redis_url, rclient):
    first = new_record("ada", "/adapters/ada", "d" * 64, 8)

    async def body(registry: LoraRegistry):
        served, added = await registry.register(first)
        assert (served, added) == (first, True)
        again, added = await registry.register(new_record("ada", "/adapters/ada", "d" * 64, 8))
        assert again == first and not added  # the first record, its created time included
        for other in (new_record("ada", "/adapters/other", "d" * 64, 8),  # another path
                      new_record("ada", "/adapters/ada", "e" * 64, 8)):  # the same path, other weights
            with pytest.raises(NameTaken) as info:
                await registry.register(other)
            assert info.value.existing == first and "/adapters/ada" in str(info.value)
        assert await registry.get("ada") == first
        assert await registry.get("nobody") is None
        await registry.register(new_record("bea", "/adapters/bea", "f" * 64, 4))
        assert [r.name for r in await registry.all()] == ["ada", "bea"]
        assert await registry.unregister("ada") == first
        assert await registry.unregister("ada") is None
        assert [r.name for r in await registry.all()] == ["bea"]

    run(redis_url, body)
    assert rclient.hkeys(keys.lora_adapters()) == [b"bea"]
    assert LoraRecord.from_json(rclient.hget(keys.lora_adapters(), "bea")).path == "/adapters/bea"


def test_racing_registrations_of_one_name_have_one_winner(redis_url):
    async def body(registry: LoraRegistry):
        records = [new_record("ada", f"/adapters/{i}", f"{i:064d}", 8) for i in range(8)]
        results = await asyncio.gather(*(registry.register(r) for r in records), return_exceptions=True)
        winners = [r for r in results if not isinstance(r, Exception)]
        assert len(winners) == 1 and winners[0][1]
        assert all(isinstance(r, NameTaken) and r.existing == winners[0][0] for r in results if r not in winners)
        assert await registry.all() == [winners[0][0]]

    run(redis_url, body)


def test_unreadable_records_are_skipped(redis_url, rclient):
    good = new_record("good", "/adapters/good", "a" * 64, 4)
    rclient.hset(keys.lora_adapters(), mapping={"good": good.to_json(), "garbage": "{not json",
                                                "renamed": new_record("other", "/x", "b" * 64, 4).to_json(),
                                                "typed": '{"name": "typed", "path": 1, "digest": "", "rank": 1, '
                                                         '"created": 0}'})

    async def body(registry: LoraRegistry):
        assert await registry.all() == [good]
        assert await registry.get("garbage") is None
        with pytest.raises(NameTaken):  # an unreadable record still holds its name
            await registry.register(new_record("garbage", "/adapters/g", "c" * 64, 4))

    run(redis_url, body)
