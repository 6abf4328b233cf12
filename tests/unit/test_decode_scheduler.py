"""Decode scheduler lifecycle with fake model outputs (no torch, no model)."""

from tandem.cluster.messages import GenerateRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.block_allocator import BlockAllocator

EOS = 2


def make(num_blocks=16, block_size=4, max_batch_size=8, max_seq_len=64):
    alloc = BlockAllocator(num_blocks, block_size)
    return alloc, DecodeScheduler(alloc, max_batch_size=max_batch_size, max_seq_len=max_seq_len, eos_token_ids=[EOS])


def request(rid, prompt_len=5, max_tokens=4, priority=0, arrival=0.0, **kw):
    spec = GenerateRequest(rid, list(range(10, 10 + prompt_len)), SamplingParams(0.0), max_tokens,
                           priority=priority, arrival_time=arrival, **kw)
    return DecodeRequest(spec=spec)


def test_full_lifecycle_frees_blocks():
    alloc, sched = make()
    req = request("a", prompt_len=5, max_tokens=4)
    sched.add(req)
    assert req.status is RequestStatus.QUEUED
    assert sched.schedule_prefills() == [req]
    assert req.status is RequestStatus.PREFILLING
    assert len(req.block_ids) == 3  # 5 + 4 tokens, block 4
    assert sched.on_prefill_done(req, first_token=7, error=None) is None
    assert req.status is RequestStatus.DECODING
    for step, token in enumerate([8, 9, 11]):
        batch = sched.schedule_decode()
        assert batch == [req]
        events = sched.on_step(batch, [token])
        assert events[0][1] == step + 1  # output index
    assert events[0][2] == "length"
    assert req.status is RequestStatus.FINISHED
    assert req.output_token_ids == [7, 8, 9, 11]
    assert alloc.num_free == alloc.num_total


def test_eos_stops_unless_ignored():
    alloc, sched = make()
    a, b = request("a"), request("b", ignore_eos=True)
    for r in (a, b):
        sched.add(r)
    sched.schedule_prefills()
    sched.on_prefill_done(a, 7, None)
    sched.on_prefill_done(b, 7, None)
    events = sched.on_step(sched.schedule_decode(), [EOS, EOS])
    assert [e[2] for e in events] == ["stop", None]
    assert sched.running == [b]


def test_first_token_can_finish():
    alloc, sched = make()
    req = request("a", max_tokens=1)
    sched.add(req)
    sched.schedule_prefills()
    assert sched.on_prefill_done(req, 7, None) == "length"
    assert not sched.running and alloc.num_free == alloc.num_total


def test_requests_queue_when_pool_is_short_and_never_pause():
    alloc, sched = make(num_blocks=4, block_size=4)  # 16 tokens
    a, b = request("a", prompt_len=6, max_tokens=6, arrival=1), request("b", prompt_len=6, max_tokens=6, arrival=2)
    sched.add(a)
    sched.add(b)
    assert sched.schedule_prefills() == [a]  # b's 12 tokens do not fit beside a's 12
    assert b.status is RequestStatus.QUEUED
    sched.on_prefill_done(a, 7, None)
    while sched.running:
        sched.on_step(sched.schedule_decode(), [9])
    assert sched.schedule_prefills() == [b]


def test_priority_then_arrival_order():
    _, sched = make(num_blocks=2, block_size=4)
    low = request("low", prompt_len=4, max_tokens=4, priority=5, arrival=1)
    high = request("high", prompt_len=4, max_tokens=4, priority=0, arrival=2)
    sched.add(low)
    sched.add(high)
    assert sched.schedule_prefills() == [high]


def test_abort_in_every_status_frees_blocks():
    alloc, sched = make()
    queued, prefilling, decoding = request("q"), request("p"), request("d")
    sched.add(decoding)
    sched.add(prefilling)
    sched.schedule_prefills()
    sched.on_prefill_done(decoding, 7, None)
    sched.add(queued)
    sched.max_batch_size = 0  # keep "q" queued
    sched.abort("q")
    assert queued.status is RequestStatus.ABORTED
    sched.abort("d")
    assert decoding.status is RequestStatus.ABORTED and not sched.running
    # a prefilling request keeps its blocks until the prefill worker lets go of them
    sched.abort("p")
    assert prefilling.status is RequestStatus.PREFILLING and prefilling.block_ids
    assert sched.on_prefill_done(prefilling, 7, None) == "abort"
    assert alloc.num_free == alloc.num_total


def test_prefill_failure_frees_blocks():
    alloc, sched = make()
    req = request("a")
    sched.add(req)
    sched.schedule_prefills()
    assert sched.on_prefill_done(req, None, "boom") == "error"
    assert req.status is RequestStatus.FAILED and alloc.num_free == alloc.num_total


def test_continuous_batching_joins_between_steps():
    _, sched = make()
    a, b = request("a", max_tokens=10), request("b", max_tokens=10)
    sched.add(a)
    sched.schedule_prefills()
    sched.on_prefill_done(a, 7, None)
    assert sched.schedule_decode() == [a]
    sched.on_step([a], [8])
    sched.add(b)
    sched.schedule_prefills()
    sched.on_prefill_done(b, 7, None)
    assert sched.schedule_decode() == [a, b]


def test_max_seq_len_caps_reservation_and_finishes():
    alloc, sched = make(max_seq_len=8)
    req = request("a", prompt_len=6, max_tokens=100)
    sched.add(req)
    sched.schedule_prefills()
    assert len(req.block_ids) == 2  # min(106, 8) tokens
    sched.on_prefill_done(req, 7, None)  # 7 tokens
    assert sched.on_step(sched.schedule_decode(), [9])[0][2] == "length"  # 8 tokens = max_seq_len
