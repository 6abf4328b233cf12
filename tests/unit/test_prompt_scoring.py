"""Jobs that score their prompt (prompt logprobs) take no prefix-cache blocks, and a
max_tokens 0 request ends at its PrefillDone without decoding (no torch)."""

from __future__ import annotations

from tandem.cluster.messages import GenerateRequest, PrefillJob
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.prefill.job import PrefillState
from tandem.prefill.scheduler import PrefillScheduler

BS = 4


def _job(rid: str, prompt: list[int], prompt_logprobs: int | None = None, resume: bool = False) -> PrefillState:
    sampling = SamplingParams(temperature=0.0, prompt_logprobs=prompt_logprobs)
    return PrefillState(job=PrefillJob(rid, prompt, sampling, 4, [0], {}, "d0", resume=resume))


def _run(sched: PrefillScheduler, state: PrefillState) -> None:
    sched.add(state)
    while state.status in (RequestStatus.QUEUED, RequestStatus.PREFILLING):
        for s, n in sched.schedule():
            sched.on_chunk_done(s, n)


def test_a_job_scoring_its_prompt_computes_every_position():
    alloc = BlockAllocator(32, BS)
    cache = PrefixCache(alloc, enabled=True)
    sched = PrefillScheduler(alloc, max_num_tokens=64, max_batch_size=8, prefix_cache=cache)
    prompt = list(range(100, 117))
    first = _job("a", prompt)
    _run(sched, first)
    sched.finish(first, RequestStatus.FINISHED)
    again = _job("b", prompt)
    _run(sched, again)
    assert again.num_cached_tokens == 16  # what a plain job reuses
    sched.finish(again, RequestStatus.FINISHED)
    scoring = _job("c", prompt, prompt_logprobs=0)
    assert scoring.scores_prompt
    _run(sched, scoring)
    assert scoring.num_cached_tokens == 0  # no logits for cached positions: computed from 0
    assert cache.num_cached == 4  # and it fills the cache as any job does
    sched.finish(scoring, RequestStatus.FINISHED)
    assert not _job("d", prompt, prompt_logprobs=2, resume=True).scores_prompt  # a resumed job scores nothing


def _decode(max_tokens: int):
    alloc = BlockAllocator(16, BS)
    sched = DecodeScheduler(alloc, max_batch_size=8, max_seq_len=64, eos_token_ids=[2])
    request = DecodeRequest(spec=GenerateRequest("r", list(range(10, 19)), SamplingParams(0.0), max_tokens))
    sched.add(request)
    assert sched.schedule_prefills() == [request]
    return alloc, sched, request


def test_max_tokens_zero_ends_at_prefill_done_by_length():
    alloc, sched, request = _decode(0)
    assert len(request.block_ids) == 3  # the prompt's blocks only
    assert sched.on_prefill_done(request, None, None) == "length"
    assert request.status is RequestStatus.FINISHED and request.output_token_ids == []
    assert alloc.num_free == alloc.num_total and not sched.running
    assert sched.pop_ended() == ["r"]  # its admission is given back


def test_no_first_token_is_still_a_failure_when_tokens_were_asked_for():
    alloc, sched, request = _decode(4)
    assert sched.on_prefill_done(request, None, None) == "error"
    assert request.status is RequestStatus.FAILED and alloc.num_free == alloc.num_total
    _, sched, request = _decode(0)
    assert sched.on_prefill_done(request, None, "transfer failed") == "error"
