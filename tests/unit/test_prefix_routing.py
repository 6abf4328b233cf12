"""The prefill workers' prefix index in Redis, and choosing a prefill worker by it (real redis-server)."""

import time

import pytest
import redis

from tandem.cluster import keys
from tandem.redis_server import RedisServer
from tandem.cluster.messages import WorkerInfo
from tandem.cluster.prefix_index import PrefixIndex, choose_prefill_worker, longest_prefixes
from tandem.engine.block_allocator import BlockAllocator
from tandem.cluster.block_hashes import block_hashes
from tandem.engine.prefix_cache import PrefixCache

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


class _Tier:
    """The host tier's side of the index (take_changes, cached_hashes, num_cached) without torch."""

    def __init__(self, hashes):
        self.held, self.pending = list(hashes), (list(hashes), [])

    @property
    def num_cached(self):
        return len(self.held)

    def cached_hashes(self):
        return list(self.held)

    def take_changes(self):
        changes, self.pending = self.pending, ([], [])
        return changes


def test_host_tier_prefixes_count_at_their_weight(client):
    from tandem.cluster.prefix_index import HOST_BLOCK_WEIGHT

    prompt = list(range(100, 124))  # 6 blocks
    hashes = block_hashes(prompt, BS)
    # "dev" holds 2 blocks on its device and blocks 2-5 in its host tier; "host" holds all 6 on its host only
    dev = PrefixIndex(client, "dev", cache_with(prompt[:8]), 5.0, 1.0, host_tier=_Tier(hashes[2:]))
    host = PrefixIndex(client, "host", cache_with([]), 5.0, 1.0, host_tier=_Tier(hashes))
    dev.sync()
    host.sync()
    assert client.smembers(keys.prefix_host_index("host")) == set(hashes)
    scores = longest_prefixes(client, ["dev", "host", "nobody"], hashes)
    assert scores == {"dev": 2 + 4 * HOST_BLOCK_WEIGHT, "host": 6 * HOST_BLOCK_WEIGHT, "nobody": 0}
    a, b = worker("dev", load=1), worker("host")
    assert choose_prefill_worker([a, b], scores, turn=0) is a  # 4 device-equivalent blocks beat 3
    dev.delete()
    host.delete()
    assert not client.exists(keys.prefix_host_index("dev"), keys.prefix_index("dev"))
