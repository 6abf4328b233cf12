"""Prefix caching on the decode side's scheduler (one device running both pools): a request's
reservation starts from the cached blocks of its longest cached prefix, a finished request's
output blocks are cached for the next turn, cached blocks nobody holds count as free and are
evicted least recently released first, and nothing leaks (no torch, no model)."""

from tandem.cluster.messages import GenerateRequest
from tandem.cluster.policies import MAX_UTILIZATION
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.caching_allocator import CachingAllocator
from tandem.cluster.block_hashes import block_hashes
from tandem.engine.prefix_cache import PrefixCache

BLOCK = 4


def make(num_blocks=16, policy="GUARANTEED_NO_EVICT", swap=None, max_seq_len=64):
    raw = BlockAllocator(num_blocks, BLOCK, hold_freed=False)  # as the worker of both pools has it
    cache = PrefixCache(raw)
    alloc = CachingAllocator(raw, cache)
    sched = DecodeScheduler(alloc, max_batch_size=8, max_seq_len=max_seq_len, eos_token_ids=[2], policy=policy,
                            prefix_cache=cache, swap=swap)
    return raw, cache, sched


def request(rid, prompt, max_tokens=4, sampling=None, **kw):
    return DecodeRequest(spec=GenerateRequest(rid, list(prompt), sampling or SamplingParams(0.0), max_tokens, **kw))


def prefill(sched, cache, req, first_token=7):
    """What the colocated worker's prefill does: compute from num_cached_tokens, caching each full prompt block."""
    hashes = req.block_hashes or block_hashes(req.prefill_token_ids, BLOCK, salt=req.spec.lora_digest)
    for index in range(req.num_cached_tokens // BLOCK, len(req.spec.prompt_token_ids) // BLOCK):
        cache.insert(hashes[index], req.block_ids[index])
    return sched.on_prefill_done(req, first_token, None)


def run_to_end(sched, req, tokens):
    for token in tokens:
        batch = sched.schedule_decode()
        assert req in batch
        events = sched.on_step(batch, [token if r is req else 9 for r in batch])
    return events


def test_the_next_turn_takes_the_prompt_and_the_answer_from_the_cache():
    raw, cache, sched = make()
    first = request("a", range(10, 20))  # 10 tokens: 2 full blocks
    sched.add(first)
    assert sched.schedule_prefills() == [first] and first.num_cached_tokens == 0
    prefill(sched, cache, first, 30)
    run_to_end(sched, first, [31, 32, 33])
    assert first.status is RequestStatus.FINISHED
    # 14 tokens, KV written for 13: blocks 0-2 are cached, and nobody holds them
    assert cache.num_cached == 3 and cache.num_evictable == 3
    assert raw.num_free + cache.num_evictable == raw.num_total
    assert sched.allocator.num_free == raw.num_total

    second = request("b", list(range(10, 20)) + [30, 31, 32, 33] + [40, 41, 42])
    expected = cache.match(block_hashes(second.spec.prompt_token_ids, BLOCK))
    sched.add(second)
    assert sched.schedule_prefills() == [second]
    assert second.num_cached_tokens == 3 * BLOCK  # the prompt's two blocks and the answer's one
    assert second.block_ids[:3] == expected and len(expected) == 3
    assert cache.num_evictable == 0  # held by the request now
    assert sched.prefix.num_device_hit_blocks == 3
    prefill(sched, cache, second)
    run_to_end(sched, second, [50, 51, 52])
    cache.clear()
    assert raw.num_free == raw.num_total  # nothing leaks


def test_cached_blocks_count_as_free_and_make_room_least_recently_released_first():
    raw, cache, sched = make(num_blocks=8)
    old = request("old", range(100, 116), max_tokens=1)  # 16 tokens + 1: 5 blocks reserved
    sched.add(old)
    sched.schedule_prefills()
    assert prefill(sched, cache, old) == "length"
    assert cache.num_evictable == 4 and sched.allocator.num_free == 8
    big = request("big", range(200, 220), max_tokens=8)  # 28 tokens: 7 blocks, more than the 4 free
    sched.add(big)
    assert sched.schedule_prefills() == [big]  # evicted cached blocks for it
    assert big.num_cached_tokens == 0 and cache.num_cached == 1
    # the prefix's first block survives (released last): a prompt sharing it still hits
    again = request("again", list(range(100, 104)) + [1, 1, 1, 1, 1], max_tokens=1)
    sched.add(again)
    assert sched.schedule_prefills() == []  # no room: 7 held, 1 cached (its own prefix) of 8
    prefill(sched, cache, big)
    run_to_end(sched, big, [3] * 7)
    assert sched.schedule_prefills() == [again] and again.num_cached_tokens == BLOCK
    prefill(sched, cache, again)
    cache.clear()
    assert raw.num_free == raw.num_total


def test_what_takes_nothing_from_the_cache():
    raw, cache, sched = make()
    first = request("a", range(10, 22), max_tokens=1)
    sched.add(first)
    sched.schedule_prefills()
    prefill(sched, cache, first)
    assert cache.num_cached == 3  # but the last block holds the last token: only the first two are reusable
    scoring = request("scores", range(10, 22), max_tokens=1,
                      sampling=SamplingParams(0.0, prompt_logprobs=1))
    other_adapter = request("lora", range(10, 22), max_tokens=1, lora_name="x", lora_digest="d1")
    same = request("same", range(10, 22), max_tokens=1)
    for r in (scoring, other_adapter, same):
        sched.add(r)
    assert sched.schedule_prefills() == [scoring, other_adapter, same]
    assert (scoring.num_cached_tokens, other_adapter.num_cached_tokens, same.num_cached_tokens) == (0, 0, 2 * BLOCK)
    for r in (scoring, other_adapter, same):
        prefill(sched, cache, r)
    assert cache.num_cached == 6  # the adapter's blocks are its own; the scoring prompt's are the same blocks'
    cache.clear()
    assert raw.num_free == raw.num_total


def test_a_paused_request_resumes_from_its_cached_blocks():
    raw, cache, sched = make(num_blocks=6, policy=MAX_UTILIZATION, max_seq_len=24)
    a = request("a", range(10, 17), max_tokens=12, arrival_time=0.0)
    b = request("b", range(40, 47), max_tokens=12, arrival_time=1.0)
    for r in (a, b):
        sched.add(r)
    assert sched.schedule_prefills() == [a, b]
    prefill(sched, cache, a)
    prefill(sched, cache, b)
    for _ in range(6):
        batch = sched.schedule_decode()
        sched.on_step(batch, [5] * len(batch))
    assert b.status is RequestStatus.PAUSED and sched.num_preemptions == 1
    while a.status is RequestStatus.DECODING:
        batch = sched.schedule_decode()
        sched.on_step(batch, [5] * len(batch))
    assert sched.schedule_prefills() == [b]
    # its recompute starts after the blocks it cached as it paused (prompt and output but the last token)
    assert b.num_cached_tokens > 0 and b.num_cached_tokens % BLOCK == 0
    assert b.num_cached_tokens < len(b.prefill_token_ids)
    assert sched.on_prefill_done(b, None, None) is None
    while b.status is RequestStatus.DECODING:
        batch = sched.schedule_decode()
        sched.on_step(batch, [5] * len(batch))
    cache.clear()
    assert raw.num_free == raw.num_total


def test_a_failed_request_caches_nothing():
    raw, cache, sched = make()
    a = request("a", range(10, 13), max_tokens=10)
    sched.add(a)
    sched.schedule_prefills()
    prefill(sched, cache, a)
    for _ in range(6):
        sched.on_step(sched.schedule_decode(), [5])
    sched.fail_running("engine error")
    assert cache.num_cached == 0 and raw.num_free == raw.num_total
