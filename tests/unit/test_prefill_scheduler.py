"""Prefill scheduler: chunking within the token budget, both policies (no torch)."""

import pytest

from cluster.messages import PrefillJob
from cluster.request_state import RequestStatus
from cluster.sampling import SamplingParams
from engine.block_allocator import BlockAllocator
from prefill.job import PrefillState
from prefill.scheduler import PrefillScheduler


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
    assert run_to_completion(sched) == [[("a", 8)], [("a", 5), ("b", 3)], [("b", 2)]]
    assert alloc.num_free == alloc.num_total


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
