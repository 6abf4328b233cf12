"""LoRA in the schedulers (no torch): at most ``max_loras`` adapters admitted together, a request
of one too many waits without starving and without holding back base-model requests, and
prefix-cache hashes that never match across adapters."""

from tandem.cluster.messages import GenerateRequest, PrefillJob
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.lora_slots import AdapterSlots
from tandem.cluster.block_hashes import block_hashes
from tandem.engine.prefix_cache import PrefixCache
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler


def decode_request(rid: str, adapter: str | None, arrival: float) -> DecodeRequest:
    spec = GenerateRequest(rid, [10, 11, 12, 13, 14], SamplingParams(0.0), 4, arrival_time=arrival)
    return DecodeRequest(spec=spec, lora_key=adapter)


def test_adapter_slots_pass_over_one_too_many_and_then_only_base_requests():
    slots = AdapterSlots(2, [decode_request("r0", "a", 0.0)])
    assert slots.admits("a") and slots.admits(None)
    slots.add("b")
    assert slots.admits("b")
    assert not slots.admits("c")  # a third adapter
    assert not slots.admits("a")  # from now on its turn comes first: "a" drains
    assert slots.admits(None)
    assert AdapterSlots(None).admits("anything")


def test_decode_admission_holds_a_third_adapter_until_one_leaves():
    alloc = BlockAllocator(64, 4)
    sched = DecodeScheduler(alloc, max_batch_size=8, max_seq_len=64, eos_token_ids=[2], max_loras=2)
    order = [("a1", "a"), ("b1", "b"), ("c1", "c"), ("a2", "a"), ("n1", None)]
    requests = {rid: decode_request(rid, adapter, i) for i, (rid, adapter) in enumerate(order)}
    for r in requests.values():
        sched.add(r)
    started = [r.request_id for r in sched.schedule_prefills()]
    # c1 is one adapter too many; a2 behind it waits too (a drains first); the base request passes
    assert started == ["a1", "b1", "n1"]
    assert {r.lora_key for r in sched.prefilling.values()} == {"a", "b", None}
    for rid in ("a1",):
        sched.on_prefill_done(requests[rid], 7, None)
    assert sched.schedule_prefills() == []  # a1 still runs: still two adapters
    requests["a1"].abort_requested = True
    sched.abort("a1")
    assert [r.request_id for r in sched.schedule_prefills()] == ["c1"]  # a left: c's turn, before a2
    assert requests["a2"].status is RequestStatus.QUEUED


def test_prefill_admission_bounds_the_adapters_in_prefill():
    alloc = BlockAllocator(64, 4)
    sched = PrefillScheduler(alloc, max_num_tokens=64, max_batch_size=8, max_loras=1)
    states = []
    for i, adapter in enumerate(["a", "b", None, "a"]):
        job = PrefillJob(f"r{i}", list(range(9)), SamplingParams(0.0), 4, [0, 1, 2], {}, "d0", arrival_time=i,
                         lora_name=adapter or "", lora_path="/x" if adapter else "",
                         lora_digest=adapter or "")
        states.append(PrefillState(job=job, lora_key=adapter))
        sched.add(states[-1])
    chunks = sched.schedule()
    assert [s.request_id for s, _ in chunks] == ["r0", "r2"]  # b waits, and a's second job behind it
    for s, n in chunks:
        assert sched.on_chunk_done(s, n)
        sched.finish(s, RequestStatus.FINISHED)
    assert [s.request_id for s, _ in sched.schedule()] == ["r1"]


def test_prefix_hashes_are_per_adapter():
    tokens = list(range(40))
    base, a, b = block_hashes(tokens, 8), block_hashes(tokens, 8, salt="d" * 64), block_hashes(tokens, 8, salt="e" * 64)
    assert len(base) == len(a) == len(b) == 5
    assert not set(base) & set(a) and not set(a) & set(b) and not set(base) & set(b)
    assert block_hashes(tokens, 8, salt="d" * 64) == a  # stable
    # through the prefill scheduler's cache: a prompt cached under adapter "a" is found again under
    # "a" only
    alloc = BlockAllocator(64, 4)
    cache = PrefixCache(alloc)
    sched = PrefillScheduler(alloc, max_num_tokens=64, max_batch_size=8, prefix_cache=cache)

    def run(rid, digest):
        job = PrefillJob(rid, tokens, SamplingParams(0.0), 4, list(range(11)), {}, "d0",
                         lora_name="x" if digest else "", lora_path="/x" if digest else "", lora_digest=digest)
        s = PrefillState(job=job)
        sched.add(s)
        (state, n), = sched.schedule()
        cached = state.num_cached_tokens
        assert sched.on_chunk_done(state, n)
        sched.finish(state, RequestStatus.FINISHED)
        return cached

    assert run("r0", "d" * 64) == 0
    assert run("r1", "e" * 64) == 0  # another adapter: nothing shared
    assert run("r2", "") == 0  # the base model: nothing shared
    assert run("r3", "d" * 64) == 36  # the first adapter again: its 9 full blocks but the last token's
