"""The host KV tier under the prefix cache (``tandem.engine.host_kv_tier``), on the CPU with a real
model: blocks the device pool evicts come back byte for byte and give the logits of a full
recompute; its LRU drops the oldest; a corrupted or dropped host block is recomputed instead of
loaded; no block leaks."""

from __future__ import annotations

import pytest
import torch

from tandem.cluster.block_hashes import block_hashes
from tandem.cluster.messages import PrefillJob
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.engine.attention import SeqChunk
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.host_kv_tier import HostKVTier, _runs, host_tier_counters
from tandem.engine.kv_cache import KVCachePool
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.runner import ModelRunner
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler

BS = 4
NUM_BLOCKS = 24  # 96 tokens: two 40-token prompts do not fit with a third


@pytest.fixture
def engine(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=NUM_BLOCKS, block_size=BS)
    alloc = BlockAllocator(NUM_BLOCKS, BS)
    tier = HostKVTier(runner.kv_pool, 64 * _block_bytes(runner))
    cache = PrefixCache(alloc, host_tier=tier)
    sched = PrefillScheduler(alloc, max_num_tokens=64, max_batch_size=4, prefix_cache=cache)
    return runner, alloc, tier, cache, sched


def _block_bytes(runner) -> int:
    kv = runner.kv_pool.kv
    return kv.shape[0] * 2 * kv[0, 0, 0].numel() * kv.element_size()


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(runner, sched, rid: str, tokens: list[int]) -> tuple[torch.Tensor, PrefillState]:
    """Admit and compute a prompt through the scheduler and the model -> (last token's logits, its state)."""
    state = PrefillState(job=PrefillJob(rid, list(tokens), SamplingParams(0.0), 4, [], {}, "d0"))
    sched.add(state)
    logits = None
    while state.status in (RequestStatus.QUEUED, RequestStatus.PREFILLING):
        chunks = sched.schedule()
        assert chunks, "job was not admitted"
        seqs = [SeqChunk(s.job.prompt_token_ids[s.num_computed : s.num_computed + n], s.num_computed, s.block_ids)
                for s, n in chunks]
        out = runner.forward(seqs)
        for i, (s, n) in enumerate(chunks):
            if s is state and s.num_computed + n == s.num_prompt_tokens:
                logits = out[i].clone()
            sched.on_chunk_done(s, n)
    sched.finish(state, RequestStatus.FINISHED)
    return logits, state


def test_evicted_prefix_comes_back_from_the_host_with_the_logits_of_a_recompute(engine, tiny_checkpoints):
    runner, alloc, tier, cache, sched = engine
    vocab = runner.config.vocab_size
    a, b, c = (_prompt(seed, 41, vocab) for seed in (1, 2, 3))
    first, _ = _prefill(runner, sched, "a", a)
    _prefill(runner, sched, "b", b)
    _prefill(runner, sched, "c", c)  # the pool is short: a's blocks are evicted to the host
    hashes = block_hashes(a, BS)
    on_device = len(cache.match(hashes))  # the pool evicts a sequence's tail first: its head may stay
    assert on_device < len(hashes) and tier.match(hashes[on_device:]) == len(hashes) - on_device
    again, state = _prefill(runner, sched, "a2", a)
    host = len(hashes) - on_device
    assert state.num_host_cached_tokens == host * BS and state.num_cached_tokens == 40  # the 11th block computed
    torch.testing.assert_close(again, first, rtol=0, atol=1e-5)
    assert tier.stats.loaded_blocks == host and tier.stats.bytes_in == host * tier.block_bytes
    cache.clear()
    assert alloc.num_free == NUM_BLOCKS  # nothing leaks


@pytest.mark.parametrize("fault", ["corrupt", "drop"])
def test_a_bad_or_dropped_host_block_is_recomputed(engine, fault):
    runner, alloc, tier, cache, sched = engine
    vocab = runner.config.vocab_size
    a = _prompt(1, 41, vocab)
    first, _ = _prefill(runner, sched, "a", a)
    for seed in (2, 3):
        _prefill(runner, sched, f"x{seed}", _prompt(seed, 41, vocab))
    hashes = block_hashes(a, BS)
    bad = len(cache.match(hashes)) + 2  # the third block of the prefix's part on the host
    if fault == "corrupt":
        tier.host[tier.slot(hashes[bad])].view(-1)[7] ^= 0x5A  # one byte of it
    else:
        tier.drop(hashes[bad])
    again, state = _prefill(runner, sched, "a2", a)
    assert state.num_host_cached_tokens == 2 * BS  # two blocks from the host, the bad one on recomputed
    torch.testing.assert_close(again, first, rtol=0, atol=1e-5)
    assert tier.stats.bad_blocks == (1 if fault == "corrupt" else 0)
    assert hashes[bad] not in tier
    cache.clear()
    assert alloc.num_free == NUM_BLOCKS


def test_a_full_tier_drops_its_least_recently_used_blocks(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=8, block_size=BS)
    tier = HostKVTier(runner.kv_pool, 3 * _block_bytes(runner))
    assert tier.capacity == 3
    runner.kv_pool.kv.normal_()
    tier.store([(b"h0", 0), (b"h1", 1), (b"h2", 2)])
    tier.store([(b"h0", 5)])  # already held: touched, not copied
    tier.store([(b"h3", 3)])  # full: h1, the least recently used, goes
    assert b"h1" not in tier and all(h in tier for h in (b"h0", b"h2", b"h3"))
    assert tier.stats.stored_blocks == 4 and tier.stats.evicted_blocks == 1
    blocks = runner.kv_pool.kv.clone()
    assert tier.load([b"h0", b"h2", b"h1"], [6, 7, 4]).wait() == 2  # up to the first it does not hold
    torch.testing.assert_close(runner.kv_pool.kv[:, :, 6], blocks[:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(runner.kv_pool.kv[:, :, 7], blocks[:, :, 2], rtol=0, atol=0)
    torch.testing.assert_close(runner.kv_pool.kv[:, :, 4], blocks[:, :, 4], rtol=0, atol=0)  # untouched


def test_runs_and_a_tier_too_small_for_a_block(tiny_checkpoints):
    assert _runs([3, 4, 5, 9, 10, 2]) == [(0, 3), (3, 5), (5, 6)]
    assert _runs([]) == []
    assert _runs(list(range(5)), 2) == [(0, 2), (2, 4), (4, 5)]
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="holds no block"):
        HostKVTier(runner.kv_pool, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_on_the_gpu_blocks_come_back_byte_for_byte_and_prefixes_give_the_same_logits(tiny_checkpoints,
                                                                                     kv_cache_dtype):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=NUM_BLOCKS, block_size=BS, device="cuda",
                         kv_cache_dtype=kv_cache_dtype)
    alloc = BlockAllocator(NUM_BLOCKS, BS)
    tier = HostKVTier(runner.kv_pool, 64 * _block_bytes(runner))
    cache = PrefixCache(alloc, host_tier=tier)
    sched = PrefillScheduler(alloc, max_num_tokens=64, max_batch_size=4, prefix_cache=cache)
    vocab = runner.config.vocab_size
    a = _prompt(1, 41, vocab)
    _prefill(runner, sched, "a", a)
    # the reference reads the prefix from the cache too: a computed chunk attends to its own keys
    # unquantized, a cached prefix to the FP8 codes the pool holds
    first, state = _prefill(runner, sched, "a1", a)
    assert state.num_cached_tokens == 40 and state.num_host_cached_tokens == 0
    for seed in (2, 3):
        _prefill(runner, sched, f"x{seed}", _prompt(seed, 41, vocab))
    again, state = _prefill(runner, sched, "a2", a)  # the stores may still be in flight: the load waits
    assert state.num_host_cached_tokens > 0
    torch.testing.assert_close(again, first, rtol=0, atol=1e-4)
    raw = runner.kv_pool.kv.view(torch.uint8)
    raw[:, :, :4].random_(0, 256)
    before = raw[:, :, :4].clone()
    tier.store([(b"r0", 0), (b"r1", 1), (b"r2", 2), (b"r3", 3)])
    assert tier.load([b"r0", b"r1", b"r2", b"r3"], [20, 21, 22, 23]).wait() == 4  # straight after the store
    torch.cuda.synchronize()
    assert torch.equal(raw[:, :, 20:24], before)


def test_the_routing_index_sees_prefix_blocks_only_and_only_once_asked():
    """A swapped-out request's blocks (stored unindexed) never reach the routing index, and a tier
    nobody indexes keeps no record of its changes (a decode worker's swap space: no growth)."""
    pool = KVCachePool(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    tier = HostKVTier(pool, 4 * pool.bytes_per_block)
    tier.store([(b"swap:r:0", 1), (b"swap:r:1", 2)], indexed=False)
    tier.store([(b"h" * 16, 3)])
    assert tier._changes == {}  # no index asked yet
    assert tier.cached_hashes() == [b"h" * 16] and tier.num_cached == 1
    assert tier.take_changes() == ([], [])
    tier.store([(b"g" * 16, 4)])
    tier.drop(b"swap:r:0")
    tier.drop(b"h" * 16)
    assert tier.take_changes() == ([b"g" * 16], [b"h" * 16])
    tier.store([(f"swap:s:{i}".encode(), 4 + i) for i in range(4)], indexed=False)  # evicts swap:r:1, then g
    assert tier.take_changes() == ([], [b"g" * 16])
    assert tier.num_cached == 0 and len(tier) == 4


def test_the_statistics_lines_count_blocks_and_the_loops_milliseconds(monkeypatch):
    """host_tier_counters: cumulative blocks stored and loaded and the host milliseconds the loop
    spent issuing copies and waiting for loads (the worker's statistics lines carry their rise);
    a load's checks run off the loop (on the CPU, on the tier's thread)."""
    from tandem.engine import host_kv_tier

    pool = KVCachePool(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    tier = HostKVTier(pool, 4 * pool.bytes_per_block)
    assert host_tier_counters(None) == {}
    assert host_tier_counters(tier) == {"tier_stored_blocks": 0, "tier_loaded_blocks": 0, "tier_issue_ms": 0,
                                        "tier_wait_ms": 0}
    checksums = host_kv_tier._checksums

    def slow(blocks):  # 50 ms a call: the counters see where it ran
        import time
        time.sleep(0.05)
        return checksums(blocks)

    monkeypatch.setattr(host_kv_tier, "_checksums", slow)
    tier.store([(b"a" * 16, 1), (b"b" * 16, 2)])  # the store's checksums: on the loop
    load = tier.load([b"a" * 16, b"b" * 16], [5, 6])  # the load's: on the tier's thread
    assert host_tier_counters(tier)["tier_issue_ms"] < 100
    assert load.wait() == 2
    counts = host_tier_counters(tier)
    assert counts["tier_stored_blocks"] == counts["tier_loaded_blocks"] == 2
    assert counts["tier_issue_ms"] >= 50 and counts["tier_wait_ms"] >= 20

class _Stream:
    """A CUDA stream as the tier orders its work on it: what each stream waited for, in order."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event.name))


class _Event:
    count = 0

    def __init__(self):
        _Event.count += 1
        self.name = f"event{_Event.count}"
        self.stream = None

    def record(self, stream):
        self.stream = stream.name
        stream.log.append((stream.name, "records", self.name))

    def query(self):
        return True

    def synchronize(self):
        pass


def test_the_streams_order_stores_after_loads_and_the_scatter_after_its_load(monkeypatch):
    """The tier's GPU ordering, with its streams recorded instead of run: a store's transfers wait
    for the compute stream (the gather) and for the last load (a slot it rewrites may be one being
    read); a load's transfers wait for nothing on the compute stream, whose scatter waits for them."""
    import contextlib

    log = []
    compute = _Stream("compute", log)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append((s.name, "uses a buffer", "")))
    pool = KVCachePool(2, 8, BS, 1, 4, torch.float32, "cpu")
    pool.kv.normal_()
    tier = HostKVTier(pool, 8 * 2 * 2 * BS * 4 * 4)
    tier.cuda = True  # the GPU paths, on CPU tensors
    tier._out_stream, tier._in_stream = _Stream("out", log), _Stream("in", log)
    stored = pool.kv[:, :, :2].clone()
    tier.store([(b"a", 0), (b"b", 1)])
    assert log[:3] == [("out", "waits for stream", "compute"), ("out", "records", "event1"), ("out", "uses a buffer", "")]
    log.clear()
    load = tier.load([b"a", b"b"], [5, 6])  # its slots' store is still in flight: the load stream waits for it
    assert ("in", "waits for stream", "compute") not in log  # its transfers start at once
    assert log[:3] == [("compute", "records", "event2"), ("in", "waits for", "event1"), ("in", "waits for", "event2")]
    assert ("in", "records", "event3") in log
    assert load.wait() == 2
    assert log[-1] == ("compute", "waits for", "event3")  # steps after it read the blocks
    assert torch.equal(pool.kv[:, :, 5:7], stored)  # the blocks came back
    tier.poll()
    log.clear()
    assert tier.load([b"a"], [7]).wait() == 1  # a landed store: nothing to wait for
    assert ("in", "waits for", "event1") not in log
    log.clear()
    tier.drop(b"a")
    tier.store([(b"c", 2)])  # into slot 0, which the loads read
    assert log[:2] == [("out", "waits for stream", "compute"), ("out", "waits for", "event5")]
