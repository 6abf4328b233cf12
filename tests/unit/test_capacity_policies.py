"""Capacity scheduler policies, driven like the decode worker drives them, with a fake model (no torch).

The fake model reads its context through the block table from a fake KV pool
and its next token is a function of that whole context. A request whose blocks
were lost, shared or recomputed wrongly after a pause therefore produces
different tokens than in a run with a pool big enough for everything.
"""

from __future__ import annotations

import pytest

from tandem.cluster.policies import capacity_policy
from tandem.cluster.messages import GenerateRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.block_allocator import BlockAllocator, blocks_for

EOS = 2
BLOCK = 4
GNE, MU, STATIC = "GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"


def next_token(context: list[int], seed: int) -> int:
    """Deterministic in (context, seed), like greedy or seeded sampling at output index len(context) - prompt."""
    h = seed
    for t in context:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return 3 + h % 200  # never EOS: lengths are set by max_tokens


class FakeEngine:
    """A KV pool of token ids, the prefill side (instant or one step late) and the decode step."""

    def __init__(self, sched: DecodeScheduler, prefill_delay_steps: int = 1):
        self.sched = sched
        self.kv: dict[tuple[int, int], int] = {}
        self.delay = prefill_delay_steps
        self.in_flight: list[tuple[int, DecodeRequest]] = []
        self.num_steps = 0
        self.max_active = 0
        self.admitted: list[list[str]] = []  # request ids admitted at each schedule_prefills that admitted any

    def write(self, block_ids, start, tokens):
        for i, token in enumerate(tokens):
            pos = start + i
            self.kv[(block_ids[pos // BLOCK], pos % BLOCK)] = token

    def read(self, block_ids, num_tokens):
        return [self.kv.get((block_ids[pos // BLOCK], pos % BLOCK)) for pos in range(num_tokens)]

    def step(self):
        """One decode-worker step: prefill results, admissions, one decode step."""
        sched = self.sched
        due = [r for at, r in self.in_flight if at <= self.num_steps]
        self.in_flight = [(at, r) for at, r in self.in_flight if at > self.num_steps]
        for request in due:
            sched.on_prefill_done(request, self._prefill(request), None)
        started = sched.schedule_prefills()
        if started:
            self.admitted.append([r.request_id for r in started])
        for request in started:
            self.in_flight.append((self.num_steps + self.delay, request))
        self.max_active = max(self.max_active, sched.num_active)
        batch = sched.schedule_decode()
        token_ids = []
        for request in batch:
            assert len(request.block_ids) * BLOCK >= request.num_tokens  # a block for the token written
            self.write(request.block_ids, request.num_tokens - 1, [request.output_token_ids[-1]])
            context = self.read(request.block_ids, request.num_tokens)
            token_ids.append(next_token(context, request.spec.sampling.seed or 0))
        sched.on_step(batch, token_ids)
        self.num_steps += 1

    def _prefill(self, request):
        tokens = request.spec.prompt_token_ids + (request.output_token_ids[:-1] if request.is_resuming else [])
        self.write(request.block_ids, 0, tokens)
        if request.is_resuming:
            return None  # the KV is back; no new token
        return next_token(self.read(request.block_ids, len(tokens)), request.spec.sampling.seed or 0)


def make(policy, num_blocks, max_batch_size=16, max_seq_len=64):
    alloc = BlockAllocator(num_blocks, BLOCK)
    return alloc, DecodeScheduler(alloc, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                  eos_token_ids=[EOS], policy=policy)


def request(rid, prompt_len=6, max_tokens=10, priority=0, arrival=0.0, seed=None):
    prompt = [10 + (hash(rid) + i) % 50 for i in range(prompt_len)]
    spec = GenerateRequest(rid, prompt, SamplingParams(1.0 if seed else 0.0, seed=seed), max_tokens,
                           priority=priority, arrival_time=arrival)
    return DecodeRequest(spec=spec)


def workload():
    """12 requests, mixed lengths and priorities, some seeded."""
    return [request(f"r{i}", prompt_len=3 + (i * 5) % 11, max_tokens=6 + (i * 7) % 17, priority=i % 3,
                    arrival=float(i), seed=(i if i % 2 else None)) for i in range(12)]


def run(policy, num_blocks, requests, max_steps=2000, **kw):
    alloc, sched = make(policy, num_blocks, **kw)
    engine = FakeEngine(sched)
    for r in requests:
        sched.add(r)
    while sched.requests:
        engine.step()
        assert engine.num_steps < max_steps, "no progress"
    assert alloc.num_free == alloc.num_total
    return {r.request_id: r.output_token_ids for r in requests}, sched, engine


def reference():
    outputs, sched, _ = run(GNE, 10_000, workload())
    return outputs


# ---- GUARANTEED_NO_EVICT ------------------------------------------------------------


def test_no_evict_never_pauses_with_a_pool_too_small_for_all():
    requests = workload()
    total_need = sum(blocks_for(r.num_prompt_tokens + r.spec.max_tokens, BLOCK) for r in requests)
    outputs, sched, engine = run(GNE, 24, requests)
    assert total_need > 24 * 2
    assert sched.num_preemptions == 0 and all(r.num_preemptions == 0 for r in requests)
    assert engine.max_active < len(requests)  # the rest queued
    assert outputs == reference()
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason == "length" for r in requests)


# ---- MAX_UTILIZATION ----------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [16, 24, 40])
def test_max_utilization_pauses_and_outputs_equal_an_unpaused_run(num_blocks):
    requests = workload()
    outputs, sched, _ = run(MU, num_blocks, requests)
    assert sched.num_preemptions > 0
    assert sched.num_preemptions == sum(r.num_preemptions for r in requests)
    assert outputs == reference()


def test_max_utilization_reserves_prompt_plus_one_and_grows():
    alloc, sched = make(MU, 32)
    req = request("a", prompt_len=8, max_tokens=12)
    sched.add(req)
    sched.schedule_prefills()
    assert len(req.block_ids) == blocks_for(8 + 1, BLOCK) == 3
    assert capacity_policy(MU).charge_tokens(8, 12, 64, BLOCK, 128) == 3 * BLOCK  # what the gateway charges
    sched.on_prefill_done(req, 7, None)
    for token in range(20, 30):
        if req.status is not RequestStatus.DECODING:
            break
        sched.on_step(sched.schedule_decode(), [token])
        assert len(req.block_ids) == blocks_for(req.num_tokens - 1, BLOCK)  # grown one step at a time


def test_admission_keeps_back_the_blocks_running_requests_need_next():
    alloc, sched = make(MU, 6)
    a = request("a", prompt_len=7, max_tokens=20, arrival=1)  # prompt + 1 = 8 tokens: 2 blocks
    sched.add(a)
    sched.schedule_prefills()
    sched.on_prefill_done(a, 7, None)
    for token in range(5):
        sched.on_step(sched.schedule_decode(), [30 + token])  # 13 tokens in 3 blocks: the next step needs a 4th
    assert sched.num_growth_blocks() == 1 and alloc.num_free == 3
    b = request("b", prompt_len=11, max_tokens=20, arrival=2)  # prompt + 1 = 12 tokens: 3 blocks
    sched.add(b)
    assert sched.schedule_prefills() == []  # 3 free, but one of them is a's next block
    sched.abort("a")
    assert sched.schedule_prefills() == [b]


def test_lowest_priority_is_paused_first_then_the_most_recently_admitted():
    alloc, sched = make(MU, 9)  # 36 tokens
    a = request("a", prompt_len=7, max_tokens=30, priority=0, arrival=1)
    low = request("low", prompt_len=7, max_tokens=30, priority=1, arrival=2)
    c = request("c", prompt_len=7, max_tokens=30, priority=0, arrival=3)
    for r in (a, low, c):
        sched.add(r)
    assert sched.schedule_prefills() == [a, c, low]  # priority order; 2 blocks each
    for r in (a, low, c):
        sched.on_prefill_done(r, 7, None)
    paused = []
    for step in range(12):
        sched.on_step(sched.schedule_decode(), [50 + step] * len(sched.running))
        paused += [r.request_id for r in (a, low, c) if r.status is RequestStatus.PAUSED and r.request_id not in paused]
    assert paused == ["low", "c"]  # low priority first, then the later admission among equals
    assert a.status is RequestStatus.DECODING and a.num_preemptions == 0
    assert sched.waiting == [c, low]  # paused requests wait in priority order
    assert low.block_ids == [] and sched.num_preemptions == 2


def test_paused_requests_wait_ahead_of_queued_ones_of_their_priority():
    _, sched = make(MU, 4)
    a = request("a", prompt_len=6, max_tokens=30, arrival=1)
    sched.add(a)
    sched.schedule_prefills()
    sched.on_prefill_done(a, 7, None)
    queued = request("queued", prompt_len=6, max_tokens=4, arrival=0.5)  # arrived earlier, still queued
    sched.add(queued)
    sched.pause(a)
    assert a.status is RequestStatus.PAUSED and sched.waiting == [a, queued]


def test_resume_reserves_everything_computed_and_skips_the_first_token():
    alloc, sched = make(MU, 32)
    req = request("a", prompt_len=6, max_tokens=20)
    sched.add(req)
    sched.schedule_prefills()
    sched.on_prefill_done(req, 7, None)
    sched.on_step(sched.schedule_decode(), [8])
    sched.on_step(sched.schedule_decode(), [9])
    sched.pause(req)
    assert alloc.num_free == alloc.num_total
    assert sched.schedule_prefills() == [req] and req.is_resuming
    assert len(req.block_ids) == blocks_for(req.num_tokens, BLOCK)  # 6 + 3 tokens
    assert sched.on_prefill_done(req, None, None) is None  # no first token
    assert req.status is RequestStatus.DECODING and req.output_token_ids == [7, 8, 9]
    assert sched.schedule_decode() == [req]


def test_failed_resume_ends_the_request():
    alloc, sched = make(MU, 32)
    req = request("a")
    sched.add(req)
    sched.schedule_prefills()
    sched.on_prefill_done(req, 7, None)
    sched.pause(req)
    sched.schedule_prefills()
    assert sched.on_prefill_done(req, None, "transfer failed") == "error"
    assert req.status is RequestStatus.FAILED and alloc.num_free == alloc.num_total


def test_abort_of_a_paused_request():
    alloc, sched = make(MU, 32)
    req = request("a")
    sched.add(req)
    sched.schedule_prefills()
    sched.on_prefill_done(req, 7, None)
    sched.pause(req)
    sched.abort("a")
    assert req.status is RequestStatus.ABORTED and not sched.waiting and not sched.requests
    assert sched.pop_ended() == ["a"] and sched.pop_ended() == []


# ---- STATIC_BATCH -------------------------------------------------------------------


def test_static_batch_runs_each_batch_to_completion_before_the_next():
    requests = [request(f"r{i}", prompt_len=6, max_tokens=4 if i % 2 == 0 else 10, arrival=float(i))
                for i in range(5)]
    outputs, sched, engine = run(STATIC, 8, requests)  # 32 tokens: two requests of 10-16 tokens at a time
    assert engine.admitted == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert sched.num_preemptions == 0
    assert outputs == run(GNE, 10_000, [request(r.request_id, prompt_len=6, max_tokens=r.spec.max_tokens)
                                        for r in requests])[0]


def test_static_batch_does_not_fill_a_finished_slot():
    alloc, sched = make(STATIC, 64)
    short, long_ = request("short", max_tokens=2, arrival=1), request("long", max_tokens=8, arrival=2)
    for r in (short, long_):
        sched.add(r)
    assert sched.schedule_prefills() == [short, long_]
    for r in (short, long_):
        sched.on_prefill_done(r, 7, None)
    sched.on_step(sched.schedule_decode(), [8, 8])
    assert short.status is RequestStatus.FINISHED
    late = request("late", arrival=3)
    sched.add(late)
    assert sched.schedule_prefills() == []  # room, but the batch is still running
    while long_.status is RequestStatus.DECODING:
        sched.on_step(sched.schedule_decode(), [9])
    assert sched.schedule_prefills() == [late]


def test_max_batch_size_bounds_a_static_batch():
    requests = [request(f"r{i}", arrival=float(i)) for i in range(5)]
    _, _, engine = run(STATIC, 1000, requests, max_batch_size=2)
    assert [len(batch) for batch in engine.admitted] == [2, 2, 1]


# ---- switching ----------------------------------------------------------------------


def test_switch_applies_to_later_admissions():
    alloc, sched = make(MU, 64)
    a = request("a", prompt_len=6, max_tokens=20)
    sched.add(a)
    sched.schedule_prefills()
    assert len(a.block_ids) == blocks_for(7, BLOCK)
    sched.set_policy(GNE)
    b = request("b", prompt_len=6, max_tokens=20)
    sched.add(b)
    sched.schedule_prefills()
    assert len(b.block_ids) == blocks_for(26, BLOCK)
    with pytest.raises(ValueError):
        sched.set_policy("NOPE")


def test_an_older_request_is_not_paused_for_a_newer_one_still_in_prefill():
    """The newest holder of blocks is paused first; a newer request in prefill cannot give its
    blocks back, so the older running one that needs a block sits the step out instead."""
    alloc, sched = make(MU, 4)
    a = request("a", prompt_len=4, max_tokens=20, arrival=1)  # prompt + 1: 2 blocks
    sched.add(a)
    sched.schedule_prefills()
    sched.on_prefill_done(a, 7, None)
    sched.on_step(sched.schedule_decode(), [30])  # 6 tokens in 2 blocks
    b = request("b", prompt_len=7, max_tokens=20, arrival=2)  # prompt + 1: the last 2 blocks
    sched.add(b)
    assert sched.schedule_prefills() == [b]
    batches = []
    for token in range(4):  # a needs a 3rd block for its 9th token; b is still in prefill
        batch = sched.schedule_decode()
        batches.append(batch)
        sched.on_step(batch, [40 + token] * len(batch))
    assert a.status is RequestStatus.DECODING and a.num_preemptions == 0
    assert batches[0] == [a] and batches[-1] == [] and len(a.block_ids) == 2  # waits, keeping its blocks
    sched.on_prefill_done(b, 9, None)  # b decodes now: the newest, it is the one paused
    sched.on_step(sched.schedule_decode(), [50])
    assert b.status is RequestStatus.PAUSED and a.status is RequestStatus.DECODING and a.num_preemptions == 0


def test_after_a_switch_to_no_evict_a_newcomer_leaves_the_older_requests_room_to_finish():
    alloc, sched = make(MU, 6)
    a = request("a", prompt_len=4, max_tokens=12, arrival=1)  # admitted with 2 blocks; grows to 4
    sched.add(a)
    sched.schedule_prefills()
    sched.on_prefill_done(a, 7, None)
    sched.set_policy(GNE)
    b = request("b", prompt_len=4, max_tokens=12, arrival=2)  # needs 4 blocks; only 2 are a's to spare
    sched.add(b)
    assert sched.schedule_prefills() == []  # the 4 free blocks include the 2 a still grows into
    while a.status is RequestStatus.DECODING:
        batch = sched.schedule_decode()
        sched.on_step(batch, [60] * len(batch))
        sched.schedule_prefills()
    assert a.num_preemptions == 0 and a.finish_reason == "length"
    assert sched.schedule_prefills() == [] and b.status is RequestStatus.PREFILLING  # admitted once a ended
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("policy", [GNE, MU, STATIC])
def test_gateway_charge_equals_the_workers_reservation(policy):
    _, sched = make(policy, 1000)
    for prompt_len, max_tokens in [(1, 1), (6, 10), (13, 40), (30, 100)]:
        req = request(f"r{prompt_len}", prompt_len=prompt_len, max_tokens=max_tokens)
        sched.add(req)
        sched.schedule_prefills()
        assert len(req.block_ids) * BLOCK == capacity_policy(policy).charge_tokens(prompt_len, max_tokens, 64, BLOCK, 4000)
        sched.abort(req.request_id)
        sched.on_prefill_done(req, None, None)
