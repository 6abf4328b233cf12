"""The prefill workers' prefix index in Redis, and choosing a prefill worker by it (real redis-server)."""

import time

import pytest
import redis

from tandem.cluster import keys
from tandem.redis_server import RedisServer
from tandem.cluster.messages import WorkerInfo
from tandem.cluster.prefix_index import PrefixIndex, choose_prefill_worker, longest_prefixes
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.prefix_cache import PrefixCache, block_hashes

BS = 4


@pytest.fixture(scope="module")
def client():
    server = RedisServer()
    yield redis.Redis.from_url(server.url)
    server.stop()


def cache_with(prompt: list[int], num_blocks: int = 16) -> PrefixCache:
    cache = PrefixCache(BlockAllocator(num_blocks, BS))
    hashes = block_hashes(prompt, BS)
    block_ids = cache.allocate(len(hashes))
    for block_hash, block_id in zip(hashes, block_ids):
        cache.insert(block_hash, block_id)
    cache.release(block_ids)
    return cache


def test_index_mirrors_the_cache_and_expires_with_the_worker(client):
    prompt = list(range(20))
    cache = cache_with(prompt)
    index = PrefixIndex(client, "p0", cache, ttl_s=5.0, refresh_s=0.05)
    index.sync()
    key = keys.prefix_index("p0")
    assert client.smembers(key) == set(block_hashes(prompt, BS))
    assert 0 < client.pttl(key) <= 5000
    cache.evict(2)  # the two tail blocks
    index.sync()
    assert client.smembers(key) == set(block_hashes(prompt, BS)[:3])
    client.delete(key)  # as if the TTL ran out while the loop stalled
    time.sleep(0.06)
    index.sync()
    assert client.smembers(key) == set(block_hashes(prompt, BS)[:3])  # written whole again
    index.delete()
    assert not client.exists(key)


def test_longest_prefixes_in_one_round_trip(client):
    shared = list(range(100, 112))
    PrefixIndex(client, "a", cache_with(shared + [1, 2, 3, 4]), 5.0, 1.0).sync()  # 4 blocks
    PrefixIndex(client, "b", cache_with(shared[:8]), 5.0, 1.0).sync()  # 2 blocks
    prompt = shared + [1, 2, 3, 4, 9, 9]
    assert longest_prefixes(client, ["a", "b", "nobody"], block_hashes(prompt, BS)) == {"a": 4, "b": 2, "nobody": 0}
    assert longest_prefixes(client, ["a", "b"], []) == {"a": 0, "b": 0}


def worker(worker_id, load=0):
    return WorkerInfo(worker_id, "prefill", "m", f"inbox:{worker_id}", 1, "h", 0.0, 0.0, 8, 8, num_running=load)


def test_choose_prefers_longest_prefix_then_load_then_takes_turns():
    a, b, c = worker("a", load=3), worker("b", load=0), worker("c", load=0)
    assert choose_prefill_worker([a, b, c], {"a": 5, "b": 2}, turn=0) is a  # the prefix beats the load
    assert choose_prefill_worker([a, b, c], {"a": 2, "b": 2}, turn=0) is b  # equal prefixes: the load decides
    picks = {choose_prefill_worker([c, b], {}, turn).worker_id for turn in range(4)}
    assert picks == {"b", "c"}  # equal in everything: turns alternate
