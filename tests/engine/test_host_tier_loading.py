"""A prefix coming back from the host KV tier does not hold up the steps: the decode-side scheduler
keeps its request LOADING (blocks reserved, no prefill yet) while the copy runs on the tier's own
lane (on the CPU, its thread), the running requests keep stepping meanwhile, and the request goes to
its prefill with the loaded blocks counted as cached once they are in, byte for byte. With nothing
else admitted the scheduler waits for the copy instead; an abort while loading frees nothing under
the copy. Real pool, tier and prefix cache on the CPU; the copy is held back by a gate."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tandem.cluster.block_hashes import block_hashes
from tandem.cluster.messages import GenerateRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine import host_kv_tier
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.caching_allocator import CachingAllocator
from tandem.engine.host_kv_tier import HostKVTier
from tandem.engine.kv_cache import KVCachePool
from tandem.engine.prefix_cache import PrefixCache

BLOCK = 4
PROMPT = list(range(10, 22))  # 3 full blocks


@pytest.fixture
def parts():
    pool = KVCachePool(2, 16, BLOCK, 1, 4, torch.float32, "cpu")
    pool.kv.normal_()
    tier = HostKVTier(pool, 8 * pool.bytes_per_block)
    raw = BlockAllocator(16, BLOCK, hold_freed=False)
    cache = PrefixCache(raw, host_tier=tier)
    sched = DecodeScheduler(CachingAllocator(raw, cache), max_batch_size=8, max_seq_len=64, eos_token_ids=[2],
                            prefix_cache=cache)
    return pool, tier, raw, cache, sched


@pytest.fixture
def gate(monkeypatch):
    """Holds every host-tier copy into the pool until set."""
    gate = threading.Event()
    scatter = host_kv_tier.ops.scatter_blocks

    def held(kv, ids, staging):
        assert gate.wait(10), "the gate was never opened"
        return scatter(kv, ids, staging)

    monkeypatch.setattr(host_kv_tier.ops, "scatter_blocks", held)
    return gate


def request(rid, prompt, max_tokens=4):
    return DecodeRequest(spec=GenerateRequest(rid, list(prompt), SamplingParams(0.0), max_tokens))


def prefill(sched, cache, req, first_token=7):
    """The colocated worker's prefill: from num_cached_tokens, caching each full prompt block."""
    hashes = block_hashes(req.prefill_token_ids, BLOCK)
    for index in range(req.num_cached_tokens // BLOCK, len(req.spec.prompt_token_ids) // BLOCK):
        cache.insert(hashes[index], req.block_ids[index])
    return sched.on_prefill_done(req, first_token, None)


def on_the_host(pool, cache, sched) -> torch.Tensor:
    """A request computes PROMPT and ends; its blocks go from the device to the host tier.
    -> their bytes."""
    first = request("first", PROMPT, max_tokens=1)
    sched.add(first)
    assert sched.schedule_prefills() == [first]
    blocks = list(first.block_ids[:3])
    prefill(sched, cache, first)
    assert first.status is RequestStatus.FINISHED
    stored = pool.kv[:, :, blocks].clone()
    cache.clear()  # evicted: stored in the host tier
    assert cache.num_cached == 0 and cache.host_tier.match(block_hashes(PROMPT, BLOCK)) == 3
    return stored


def test_the_running_requests_step_while_a_prefix_comes_back(parts, gate):
    pool, tier, raw, cache, sched = parts
    stored = on_the_host(pool, cache, sched)
    runner = request("runner", range(100, 106), max_tokens=8)
    sched.add(runner)
    assert sched.schedule_prefills() == [runner]
    prefill(sched, cache, runner)
    turn = request("turn", PROMPT + [40, 41, 42])
    sched.add(turn)
    assert sched.schedule_prefills() == []  # its copy is held: no prefill yet
    assert list(sched.loading) == ["turn"] and turn.status is RequestStatus.PREFILLING
    assert turn.num_cached_tokens == 0 and sched.num_active == 2
    for _ in range(3):  # the running request steps meanwhile
        batch = sched.schedule_decode()
        assert batch == [runner]
        sched.on_step(batch, [9])
        assert sched.schedule_prefills() == []
    gate.set()
    deadline = time.monotonic() + 10
    started = []
    while not started and time.monotonic() < deadline:
        started = sched.schedule_prefills()
    assert started == [turn] and not sched.loading
    assert turn.num_cached_tokens == 3 * BLOCK  # its prompt's three blocks, from the host
    assert torch.equal(pool.kv[:, :, turn.block_ids[:3]], stored)
    assert cache.match(block_hashes(PROMPT, BLOCK)) == turn.block_ids[:3]  # cached again on the device
    assert tier.stats.loaded_blocks == 3
    prefill(sched, cache, turn)
    for req in (runner, turn):
        while req.status is RequestStatus.DECODING:
            batch = sched.schedule_decode()
            sched.on_step(batch, [9] * len(batch))
    cache.clear()
    assert raw.num_free == raw.num_total  # nothing leaks


def test_with_nothing_else_admitted_the_scheduler_waits_for_the_copy(parts, gate):
    pool, tier, raw, cache, sched = parts
    on_the_host(pool, cache, sched)
    turn = request("turn", PROMPT + [40])
    sched.add(turn)
    assert sched.schedule_prefills() == []  # issued
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    began = time.monotonic()
    assert sched.schedule_prefills() == [turn]  # nothing runs: it waits for the copy
    assert time.monotonic() - began >= 0.15
    assert turn.num_cached_tokens == 3 * BLOCK


def test_an_abort_while_loading_frees_the_blocks_only_after_the_copy(parts, gate):
    pool, tier, raw, cache, sched = parts
    on_the_host(pool, cache, sched)
    turn = request("turn", PROMPT + [40])
    sched.add(turn)
    sched.schedule_prefills()
    sched.abort("turn")
    assert turn.status is RequestStatus.PREFILLING and "turn" in sched.loading  # its blocks are being written
    gate.set()
    started = sched.schedule_prefills()
    assert started == [turn] and turn.abort_requested
    assert sched.on_prefill_done(turn, None, "aborted") == "abort"  # what the worker's check does with it
    cache.clear()
    assert raw.num_free == raw.num_total


def test_a_prefill_worker_with_nothing_to_compute_waits_for_its_oldest_copy_only(monkeypatch):
    """The prefill scheduler's form: two jobs whose prefixes are on the host; with nothing else to
    compute it waits for the first job's copy, not the second's, which joins once it is in."""
    from tandem.cluster.messages import PrefillJob
    from tandem.prefill.job import PrefillState
    from tandem.prefill.scheduler import PrefillScheduler

    gates = [threading.Event(), threading.Event()]
    calls = []
    scatter = host_kv_tier.ops.scatter_blocks

    def held(kv, ids, staging):  # the n-th copy waits for the n-th gate
        gate = gates[len(calls)]
        calls.append(1)
        assert gate.wait(10), "the gate was never opened"
        return scatter(kv, ids, staging)

    monkeypatch.setattr(host_kv_tier.ops, "scatter_blocks", held)
    pool = KVCachePool(2, 32, BLOCK, 1, 4, torch.float32, "cpu")
    tier = HostKVTier(pool, 16 * pool.bytes_per_block)
    raw = BlockAllocator(32, BLOCK)
    sched = PrefillScheduler(raw, max_num_tokens=64, max_batch_size=4, prefix_cache=PrefixCache(raw, host_tier=tier))
    prompts = [PROMPT + [40, 41], [p + 50 for p in PROMPT] + [40]]
    for i, prompt in enumerate(prompts):  # their prefixes were evicted to the host earlier
        tier.store([(h, b) for h, b in zip(block_hashes(prompt, BLOCK)[:3], range(3 * i, 3 * i + 3))])
    states = [PrefillState(job=PrefillJob(f"j{i}", prompt, SamplingParams(0.0), 4, [], {}, "d0"))
              for i, prompt in enumerate(prompts)]
    for state in states:
        sched.add(state)
    threading.Timer(0.1, gates[0].set).start()
    chunks = sched.schedule()  # nothing to compute: waits for j0's copy, not j1's
    assert [state.request_id for state, _ in chunks] == ["j0"] and sched.loading == [states[1]]
    assert states[0].num_host_cached_tokens == 3 * BLOCK and states[0].num_computed == 3 * BLOCK
    gates[1].set()
    deadline = time.monotonic() + 10
    while sched.loading and time.monotonic() < deadline:
        sched.schedule()
    assert not sched.loading and states[1].num_host_cached_tokens == 3 * BLOCK
