"""Prefill scheduler: chunking within the token budget, both policies (no torch)."""

import random

import pytest

from tandem.cluster.messages import PrefillJob
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.engine.block_allocator import BlockAllocator
from tandem.prefill.job import PrefillState
from tandem.cluster.policies import EqualProgress, FirstComeFirstServed
from tandem.prefill.scheduler import PrefillScheduler

first_come_chunks = FirstComeFirstServed().chunk_sizes
equal_progress_chunks = EqualProgress().chunk_sizes


def state(rid, prompt_len, arrival=0.0, priority=0):
    job = PrefillJob(rid, list(range(prompt_len)), SamplingParams(0.0), 4, [], {}, "d0",
                     priority=priority, arrival_time=arrival)
    return PrefillState(job=job)


def make(policy="FIRST_COME_FIRST_SERVED", budget=8, num_blocks=64, block_size=4):
    alloc = BlockAllocator(num_blocks, block_size)
    return alloc, PrefillScheduler(alloc, max_num_tokens=budget, max_batch_size=8, policy=policy)


def run_to_completion(sched):
    order = []
    while True:
        chunks = sched.schedule()
        if not chunks:
            return order
        assert sum(n for _, n in chunks) <= sched.max_num_tokens
        order.append([(s.request_id, n) for s, n in chunks])
        for s, n in chunks:
            if sched.on_chunk_done(s, n):
                sched.finish(s, RequestStatus.FINISHED)


def test_fcfs_finishes_earliest_first():
    alloc, sched = make()
    sched.add(state("a", 13, arrival=1))
    sched.add(state("b", 5, arrival=2))
    # b's 3 left over would end mid-block (a chunk other than the last is whole blocks): it waits
    assert run_to_completion(sched) == [[("a", 8)], [("a", 5)], [("b", 5)]]
    assert alloc.num_free == alloc.num_total


def test_chunks_other_than_the_last_are_whole_blocks():
    """TensorRT-LLM's chunk unit: FIRST_COME_FIRST_SERVED rounds a job's chunk down to whole blocks
    unless it is the job's last; EQUAL_PROGRESS hands out one block per job per round, passing over
    a job whose next block does not fit, and uses the rest of the budget."""
    assert first_come_chunks([10, 200], 64, 16) == [10, 48]
    assert first_come_chunks([100, 5], 64, 16) == [64, 0]
    assert first_come_chunks([20, 30, 7], 40, 16) == [20, 16, 0]  # 4 left: c's 7 do not fit
    assert equal_progress_chunks([16, 1000], 64, 16) == [16, 48]  # a's unused share goes on to b
    assert equal_progress_chunks([40, 10], 64, 16) == [40, 10]  # both fit whole: one forward
    assert equal_progress_chunks([100, 100, 100], 40, 16) == [16, 16, 0]  # whole blocks only
    assert equal_progress_chunks([100, 100, 5], 40, 16) == [16, 16, 5]  # a last, short increment fits
    assert equal_progress_chunks([], 64, 16) == []
    rng = random.Random(0)
    cases = [([3, 70, 33, 1], 64), ([500] * 7, 100), ([17, 15, 64], 48)] + [
        ([rng.randint(1, 300) for _ in range(rng.randint(1, 9))], rng.choice([16, 48, 64, 100, 2048]))
        for _ in range(200)]
    for remaining, budget in cases:
        sizes = equal_progress_chunks(remaining, budget, 16)
        assert sum(sizes) <= budget and all(n == r or n % 16 == 0 for n, r in zip(sizes, remaining))
        assert sizes == _equal_progress_by_rounds(remaining, budget, 16)


def _equal_progress_by_rounds(remaining, budget, unit):
    """The policy as TensorRT-LLM writes it: one increment per job per round while any fits."""
    sizes, progress = [0] * len(remaining), True
    while progress:
        progress = False
        for i, need in enumerate(remaining):
            step = min(unit, need - sizes[i])
            if 0 < step <= budget:
                sizes[i], budget, progress = sizes[i] + step, budget - step, True
    return sizes


def test_equal_progress_gives_every_job_a_chunk():
    _, sched = make("EQUAL_PROGRESS", budget=8)
    sched.add(state("a", 13, arrival=1))
    sched.add(state("b", 9, arrival=2))
    order = run_to_completion(sched)
    assert order[0] == [("a", 4), ("b", 4)]
    assert order[1] == [("a", 4), ("b", 4)]


def test_waits_for_local_blocks():
    alloc, sched = make(num_blocks=4, block_size=4)
    sched.add(state("a", 12, arrival=1))
    sched.add(state("b", 8, arrival=2))
    chunks = sched.schedule()
    assert [s.request_id for s, _ in chunks] == ["a"]
    assert sched.waiting[0].request_id == "b"


def test_priority_orders_admission():
    _, sched = make(num_blocks=3, block_size=4)
    sched.add(state("low", 8, arrival=1, priority=3))
    sched.add(state("high", 8, arrival=2, priority=0))
    assert [s.request_id for s, _ in sched.schedule()] == ["high"]


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="FIRST_COME_FIRST_SERVED"):
        make("SHORTEST_FIRST")


def test_drain_keeps_blocks_until_finish():
    alloc, sched = make()
    sched.add(state("a", 13))
    (job, n), = sched.schedule()
    sched.on_chunk_done(job, n)
    held = alloc.num_free
    sched.drain(job)  # given up while a write may still read its blocks
    assert job.status is RequestStatus.TRANSFERRING and job in sched.transferring
    assert alloc.num_free == held and sched.schedule() == []
    sched.finish(job, RequestStatus.ABORTED)
    assert alloc.num_free == alloc.num_total
