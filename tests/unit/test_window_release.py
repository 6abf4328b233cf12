"""Sliding-window block release in both schedulers, against a simulated KV pool (no torch).

The simulation writes (request, position) into the slot each new token's K/V
would go to and, at every step, reads back every key the window lets the
query see: a released block that was read, or written by someone else while
still needed, shows up as a wrong entry.
"""

from tandem.cluster.messages import GenerateRequest, PrefillJob
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.window import SlidingWindow, held_block_ids
from tandem.engine.block_allocator import BlockAllocator, blocks_for
from tandem.engine.prefix_cache import PrefixCache
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler

BS, W = 4, 10
MAX_LIVE = blocks_for(W - 1, BS) + 1  # 10 consecutive positions touch at most 4 blocks of 4


def request(rid, prompt_len, max_tokens, arrival=0.0):
    spec = GenerateRequest(rid, list(range(3, 3 + prompt_len)), SamplingParams(0.0), max_tokens,
                           arrival_time=arrival, ignore_eos=True)
    return DecodeRequest(spec=spec)


class FakePool:
    def __init__(self):
        self.slots: dict[int, tuple[str, int]] = {}

    def write(self, req: DecodeRequest, pos: int) -> None:
        self.slots[req.block_ids[pos // BS] * BS + pos % BS] = (req.request_id, pos)

    def check_window(self, req: DecodeRequest, pos: int) -> None:
        for key in range(max(0, pos - W + 1), pos + 1):
            block = req.block_ids[key // BS]
            assert block in held_block_ids(req), (req.request_id, pos, key)
            assert self.slots[block * BS + key % BS] == (req.request_id, key), (req.request_id, pos, key)


def test_window_reservation_is_bounded():
    window = SlidingWindow(BlockAllocator(8, BS), W)
    assert window.max_live_blocks == MAX_LIVE
    assert window.reserved_tokens(6, 46) == MAX_LIVE * BS  # instead of 46
    assert window.reserved_tokens(30, 100) == 30  # a long prompt still needs all its blocks to land in
    assert window.reserved_tokens(5, 9) == 9  # short requests: no change


def test_decode_releases_and_recycles_blocks_within_the_window():
    alloc = BlockAllocator(10, BS)  # 40 tokens: not one 6 + 40 request without the window
    sched = DecodeScheduler(alloc, max_batch_size=8, max_seq_len=128, eos_token_ids=[2], attention_window=W)
    pool = FakePool()
    reqs = [request("a", 6, 40, 1.0), request("b", 23, 30, 2.0), request("c", 9, 25, 3.0)]
    for r in reqs:
        sched.add(r)
    peak_held = {}
    step = 0
    while any(r.status is not RequestStatus.FINISHED for r in reqs):
        for r in sched.schedule_prefills():  # the prefill worker fills the prompt's blocks
            assert len(r.block_ids) == blocks_for(sched.reserved_tokens(r), BS)
            for pos in range(r.num_prompt_tokens):
                pool.write(r, pos)
            assert sched.on_prefill_done(r, first_token=5, error=None) is None
        batch = sched.schedule_decode()
        assert batch or step == 0
        for r in batch:
            pos = r.num_tokens - 1
            held_by_others = {b for o in batch if o is not r for b in held_block_ids(o)}
            assert r.block_ids[pos // BS] in held_block_ids(r)
            assert r.block_ids[pos // BS] not in held_by_others
            pool.write(r, pos)
            pool.check_window(r, pos)
            peak_held[r.request_id] = max(peak_held.get(r.request_id, 0), len(held_block_ids(r)))
        sched.on_step(batch, [7] * len(batch))
        for r in sched.running:
            assert len(held_block_ids(r)) <= MAX_LIVE  # after its prompt, at most a window's blocks
        held = sum(len(held_block_ids(r)) for r in sched.running + list(sched.prefilling.values()))
        assert alloc.num_free + held == alloc.num_total  # nothing leaks, nothing is counted twice
        step += 1
    assert all(len(r.output_token_ids) == r.spec.max_tokens for r in reqs)
    assert peak_held == {"a": MAX_LIVE, "b": MAX_LIVE, "c": MAX_LIVE}
    assert alloc.num_free == alloc.num_total


def test_decode_without_window_keeps_the_full_reservation():
    alloc = BlockAllocator(16, BS)
    sched = DecodeScheduler(alloc, max_batch_size=8, max_seq_len=128, eos_token_ids=[2])
    r = request("a", 6, 30)
    sched.add(r)
    sched.schedule_prefills()
    sched.on_prefill_done(r, 5, None)
    for _ in range(10):
        sched.on_step([r], [7])
    assert r.num_released_blocks == 0 and len(held_block_ids(r)) == blocks_for(36, BS)


def test_abort_of_a_windowed_request_frees_what_it_holds():
    alloc = BlockAllocator(10, BS)
    sched = DecodeScheduler(alloc, max_batch_size=8, max_seq_len=128, eos_token_ids=[2], attention_window=W)
    r = request("a", 6, 40)
    sched.add(r)
    sched.schedule_prefills()
    sched.on_prefill_done(r, 5, None)
    for _ in range(17):
        sched.on_step([r], [7])
    assert r.num_released_blocks > 0
    sched.abort("a")
    assert alloc.num_free == alloc.num_total


def prefill_state(rid, prompt_len):
    return PrefillState(job=PrefillJob(rid, list(range(prompt_len)), SamplingParams(0.0), 4, [], {}, "d0"))


def test_prefill_releases_blocks_between_chunks_that_later_chunks_never_touch():
    alloc = BlockAllocator(32, BS)
    sched = PrefillScheduler(alloc, max_num_tokens=8, max_batch_size=4, attention_window=W)
    state = prefill_state("a", 41)
    sched.add(state)
    released = set()
    free_after = []
    while state.status is RequestStatus.PREFILLING or state.status is RequestStatus.QUEUED:
        [(s, n)] = sched.schedule()
        first_key = max(0, s.num_computed - W + 1)  # the chunk's earliest query reads from here
        touched = {s.block_ids[p // BS] for p in range(first_key, s.num_computed + n)}
        assert not touched & released
        sched.on_chunk_done(s, n)
        before = s.num_released_blocks
        sched.release_out_of_window(s)
        released |= set(s.block_ids[before : s.num_released_blocks])
        free_after.append(alloc.num_free)
    assert state.status is RequestStatus.TRANSFERRING
    assert state.num_released_blocks == 7  # the last chunk's queries from 40 read keys from 31 on (block 7)
    assert free_after == sorted(free_after) and free_after[-1] > free_after[0]
    sched.finish(state, RequestStatus.FINISHED)
    assert alloc.num_free == alloc.num_total


def test_prefill_window_release_keeps_cached_blocks_for_later_prompts():
    alloc = BlockAllocator(32, BS)
    cache = PrefixCache(alloc)
    sched = PrefillScheduler(alloc, max_num_tokens=8, max_batch_size=4, prefix_cache=cache, attention_window=W)
    first = prefill_state("a", 33)
    sched.add(first)
    while first.status is not RequestStatus.TRANSFERRING:
        for s, n in sched.schedule():
            sched.on_chunk_done(s, n)
            sched.release_out_of_window(s)
    assert first.num_released_blocks > 0 and cache.num_evictable == first.num_released_blocks
    sched.finish(first, RequestStatus.FINISHED)
    second = prefill_state("b", 33)
    sched.add(second)
    [(s, n)] = sched.schedule()
    assert s.num_cached_tokens == 32 and n == 1
    sched.on_chunk_done(s, n)
    sched.finish(s, RequestStatus.FINISHED)
    cache.clear()
    assert alloc.num_free == alloc.num_total
