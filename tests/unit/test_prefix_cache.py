"""Prefix cache: chained hashes, reuse through the prefill scheduler, ref counts, LRU eviction, no leaks."""

import os
import subprocess
import sys

import pytest

from tandem.cluster.messages import PrefillJob
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.engine.block_allocator import BlockAllocator, OutOfBlocks
from tandem.cluster.block_hashes import block_hashes, num_reusable_blocks
from tandem.engine.prefix_cache import PrefixCache
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler

BS = 4


def test_module_is_torch_free():
    code = "import sys, tandem.engine.prefix_cache, tandem.cluster.prefix_index; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hash_chain_covers_the_whole_prefix():
    a = block_hashes(list(range(14)), BS)
    assert len(a) == 3  # 14 tokens: three full blocks, the partial one is not hashed
    assert len(set(a)) == 3
    b = block_hashes(list(range(12)) + [99, 98], BS)
    assert b == a  # same full blocks, whatever the tail
    c = block_hashes([0, 1, 2, 3, 4, 5, 6, 77, 8, 9, 10, 11], BS)
    assert c[0] == a[0] and c[1] != a[1] and c[2] != a[2]  # a change in block 1 renames every later block
    # block 2 alone equal, different prefix: a different hash (the chain, not the block's own tokens)
    d = block_hashes([50, 51, 52, 53, 4, 5, 6, 7, 8, 9, 10, 11], BS)
    assert d[2] != a[2]
    assert block_hashes([1, 2, 3], BS) == []


def test_hashes_are_stable_across_processes():
    code = "from tandem.cluster.block_hashes import block_hashes; print(block_hashes(list(range(9)), 4)[1].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {block_hashes(list(range(9)), 4)[1].hex()}


def test_last_token_is_always_recomputed():
    assert num_reusable_blocks(12, BS) == 2  # 12 tokens = 3 full blocks, but the last token needs logits
    assert num_reusable_blocks(13, BS) == 3
    assert num_reusable_blocks(1, BS) == 0


# ---- through the prefill scheduler -------------------------------------------------------


def job(rid, tokens):
    return PrefillState(job=PrefillJob(rid, list(tokens), SamplingParams(0.0), 4, [], {}, "d0"))


def make(num_blocks=32, budget=64, window=None, enabled=True):
    alloc = BlockAllocator(num_blocks, BS)
    cache = PrefixCache(alloc, enabled=enabled)
    sched = PrefillScheduler(alloc, max_num_tokens=budget, max_batch_size=8, prefix_cache=cache,
                             attention_window=window)
    return alloc, cache, sched


def run(sched, state):
    """Admit ``state`` and compute its prompt; returns the chunks it took."""
    sched.add(state)
    taken = []
    while state.status in (RequestStatus.QUEUED, RequestStatus.PREFILLING):
        chunks = sched.schedule()
        assert chunks, "job was not admitted"
        for s, n in chunks:
            if s is state:
                taken.append((s.num_computed, n))
            sched.on_chunk_done(s, n)
    return taken


def test_second_prompt_reuses_the_shared_full_blocks():
    alloc, cache, sched = make()
    system = list(range(100, 113))  # 13 tokens: 3 full blocks
    a = job("a", system + [1, 2, 3])
    assert run(sched, a) == [(0, 16)]
    assert a.num_cached_tokens == 0
    assert cache.num_cached == 4  # every full block of a's 16 tokens
    a_blocks = list(a.block_ids)
    sched.finish(a, RequestStatus.FINISHED)
    assert cache.num_evictable == 4 and alloc.num_free == alloc.num_total - 4

    b = job("b", system + [7, 8, 9, 10, 11])  # shares 13 tokens: 3 full blocks
    assert run(sched, b) == [(12, 6)]  # computing starts after the cached blocks
    assert b.num_cached_tokens == 12
    assert b.block_ids[:3] == a_blocks[:3]
    assert [alloc.ref_count(x) for x in b.block_ids[:3]] == [2, 2, 2]  # the cache and b
    assert cache.num_evictable == 1  # a's 4th block, which b does not share
    b_blocks = list(b.block_ids)
    sched.finish(b, RequestStatus.FINISHED)
    assert [alloc.ref_count(x) for x in b_blocks] == [1, 1, 1, 1, 0]  # 4 cached (the cache's own ref), 1 free
    assert cache.clear() == 5  # a's 4 blocks and b's full 4th one
    assert cache.num_cached == 0 and alloc.num_free == alloc.num_total


def test_identical_prompt_recomputes_its_last_block():
    alloc, cache, sched = make()
    prompt = list(range(200, 212))  # exactly 3 blocks
    first = job("a", prompt)
    run(sched, first)
    sched.finish(first, RequestStatus.FINISHED)
    again = job("b", prompt)
    assert run(sched, again) == [(8, 4)]  # the last block is computed again for the last token's logits
    assert again.num_cached_tokens == 8
    sched.finish(again, RequestStatus.FINISHED)
    cache.clear()
    assert alloc.num_free == alloc.num_total


def test_concurrent_jobs_with_one_prefix_cache_it_once_and_do_not_leak():
    alloc, cache, sched = make()
    a, b = job("a", range(300, 309)), job("b", range(300, 309))
    sched.add(a)
    sched.add(b)
    for s, n in sched.schedule():  # both admitted before either cached anything
        sched.on_chunk_done(s, n)
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert cache.num_cached == 2  # a's blocks; b's equal blocks stay private
    assert not any(cache.is_cached(x) for x in b.block_ids)
    sched.finish(a, RequestStatus.FINISHED)
    sched.finish(b, RequestStatus.FINISHED)
    assert alloc.num_free + cache.num_evictable == alloc.num_total
    cache.clear()
    assert alloc.num_free == alloc.num_total


def test_allocation_evicts_least_recently_used_before_failing():
    alloc, cache, sched = make(num_blocks=8)
    old, new = job("old", range(0, 8)), job("new", range(50, 58))  # 2 full blocks each
    old_blocks = []
    for s in (old, new):
        run(sched, s)
        old_blocks = old_blocks or list(s.block_ids)
        sched.finish(s, RequestStatus.FINISHED)
    assert cache.num_evictable == 4 and alloc.num_free == 4
    assert cache.can_allocate(8) and not cache.can_allocate(9)
    taken = cache.allocate(5)  # 4 free + 1 evicted: the tail block of the oldest prompt
    assert len(taken) == 5 and cache.num_evictable == 3
    # old's tail block went first; its prefix block survives
    assert cache.match(block_hashes(list(range(0, 8)), BS)) == old_blocks[:1]
    assert len(cache.match(block_hashes(list(range(50, 58)), BS))) == 2  # the newer prompt is intact
    with pytest.raises(OutOfBlocks):
        cache.allocate(4)
    alloc.free(taken)
    cache.clear()
    assert alloc.num_free == alloc.num_total


def test_a_job_waits_when_the_pool_is_short_and_is_admitted_after_eviction():
    alloc, cache, sched = make(num_blocks=6)
    run(sched, job("a", range(0, 16)))  # 4 blocks, all cached
    sched.finish(sched.transferring[0], RequestStatus.FINISHED)
    big = job("big", range(100, 124))  # 6 blocks: needs every cached block evicted
    assert run(sched, big) == [(0, 24)]
    assert cache.num_cached == 6 and cache.num_evictable == 0  # big's own blocks, the old ones evicted
    held = job("held", range(100, 109))  # matches big's first 2 blocks, needs 1 more: none left
    sched.add(held)
    assert sched.schedule() == [] and held.status is RequestStatus.QUEUED
    assert all(alloc.ref_count(x) == 2 for x in big.block_ids)  # the cache and big; the failed match let go
    sched.finish(big, RequestStatus.FINISHED)
    chunks = sched.schedule()
    assert [(s.request_id, s.num_computed, n) for s, n in chunks] == [("held", 8, 1)]
    assert held.num_cached_tokens == 8


def test_disabled_cache_is_a_pass_through():
    alloc, cache, sched = make(enabled=False)
    for rid in ("a", "b"):
        s = job(rid, range(0, 13))
        run(sched, s)
        assert s.num_cached_tokens == 0 and not s.block_hashes
        sched.finish(s, RequestStatus.FINISHED)
    assert cache.num_cached == 0 and alloc.num_free == alloc.num_total


def test_take_changes_reports_the_net_state():
    alloc = BlockAllocator(4, BS)
    cache = PrefixCache(alloc)
    h = block_hashes(list(range(8)), BS)
    ids = cache.allocate(2)
    cache.insert(h[0], ids[0])
    cache.insert(h[1], ids[1])
    assert cache.take_changes() == ([h[0], h[1]], [])
    cache.release(ids)
    cache.evict(1)  # the tail block goes first
    assert cache.take_changes() == ([], [h[1]])
    again = cache.allocate(1)
    cache.insert(h[1], again[0])
    cache.evict(5)  # only h[0] is evictable
    assert cache.take_changes() == ([h[1]], [h[0]])


def test_a_chain_goes_on_from_its_last_hash():
    tokens = list(range(3, 40))
    whole = block_hashes(tokens, 4, salt="d")
    assert block_hashes(tokens[12:], 4, salt="ignored", parent=whole[2]) == whole[3:]
