"""Penalties in the decode loop (decode.step_penalties): each penalized request's slot counts its
output on the device, right after sampling, so a step launched before the previous step's
tokens reach the host (run-ahead) still sees every token; a slot that counted a dropped
row is filled again from the host; slots go back when requests end, abort or pause, and a
resumed request's slot starts from the output tokens it brings. The loop runs with the
fakes of ``test_decode_loop``."""

import dataclasses
from collections import Counter

import pytest
import torch

from tandem.cluster.messages import AbortRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tests.unit.test_decode_loop import _running, _worker

VOCAB = 10
# the fake model's logits, the same at every position: greedy decoding repeats token 7 unless penalized
BASE = torch.tensor([0.0, 0.2, -5.0, 0.5, 0.8, 0.3, 0.9, 1.0, 0.1, 0.0])


class _FixedRunner:
    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def forward(self, chunks, feed=None):
        self.calls.append(feed is not None)
        return BASE.repeat(len(chunks), 1)


def _reference(params: SamplingParams, prompt: list[int], first: int, n: int) -> list[int]:
    """Greedy tokens 1..n-1 after ``first``, penalties applied by their definitions."""
    out = [first]
    while len(out) < n:
        logits = BASE.clone()
        counts = Counter(out)
        for t in set(prompt) | set(out):
            p = params.repetition_penalty
            logits[t] = logits[t] * p if logits[t] < 0 else logits[t] / p
        for t, c in counts.items():
            logits[t] -= params.frequency_penalty * c + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


def _penalized_worker(run_ahead=True):
    worker = _worker(run_ahead=run_ahead)
    worker.runner = worker.steps.runner = _FixedRunner()
    return worker


def _slot_counts(worker, request) -> list[int]:
    slots = worker.steps.penalties.slots
    return [int(c) for c in slots.counts[slots.slot(request.request_id)].tolist()]


def _expected_counts(worker, request) -> list[int]:
    """Its host-known output, and the token still on the device when a step holds one."""
    tokens = list(request.output_token_ids)
    step = worker.steps.in_flight
    if request.num_pending and step is not None:
        tokens.append(int(step.tokens.device_tokens[step.batch.index(request)]))
    counts = Counter(tokens)
    return [counts[t] for t in range(VOCAB)]


@pytest.mark.parametrize("run_ahead", [True, False])
def test_counts_follow_the_output_across_steps_launched_ahead(run_ahead):
    worker = _penalized_worker(run_ahead)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.15, presence_penalty=0.05, repetition_penalty=1.1)
    penalized = _running(worker, "p", max_tokens=12)
    penalized.spec.sampling = params
    plain = _running(worker, "q", max_tokens=12)  # in the same steps, without penalties
    while penalized.status is RequestStatus.DECODING:
        worker.step()
        if penalized.status is RequestStatus.DECODING:
            assert _slot_counts(worker, penalized) == _expected_counts(worker, penalized)
    assert penalized.output_token_ids == _reference(params, [1, 2, 3], 5, 12)
    assert len(set(penalized.output_token_ids)) > 3  # the penalties moved it off token 7
    assert plain.output_token_ids == [5] + [7] * 11
    if run_ahead:
        assert any(worker.runner.calls)  # steps were fed from the step still on the device
    worker.step()
    assert worker.steps.penalties.slots.num_used == 0  # the finished request gave its slot back


def test_logit_bias_alone_takes_no_slot():
    worker = _penalized_worker()
    request = _running(worker, "b", max_tokens=4)
    request.spec.sampling = SamplingParams(temperature=0.0, logit_bias=((7, -10.0), (3, 1.0)))
    while request.status is RequestStatus.DECODING:
        worker.step()
    assert request.output_token_ids == [5, 3, 3, 3] and worker.steps.penalties.slots is None


def test_a_dropped_row_refills_its_slot_from_the_host():
    """A row launched before its request's previous token was known, then dropped (the host
    records nothing for it): the slot counted a token the output never got; the next step
    fills it again from the host-known output."""
    worker = _penalized_worker()
    request = _running(worker, "p", max_tokens=20)
    request.spec.sampling = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    steps = worker.steps
    steps.launch([request], None)
    first = steps.in_flight
    steps.launch([request], first)  # ahead: fed step 1's token
    second = steps.in_flight
    slots = steps.penalties.slots
    assert slots.counted("p") == 3 and sum(_slot_counts(worker, request)) == 3
    steps.read(first)
    steps.read(second)
    request.num_pending = 0  # both rows dropped: out of step with the device
    steps.launch([request], None)
    assert slots.counted("p") == 2  # refilled from [5], then this step's token counted
    want = Counter([5, int(steps.in_flight.tokens.device_tokens[0])])
    assert _slot_counts(worker, request) == [want[t] for t in range(VOCAB)]


def test_a_refill_counts_the_token_still_on_the_device():
    worker = _penalized_worker()
    request = _running(worker, "p", max_tokens=20)
    request.spec.sampling = SamplingParams(temperature=0.0, presence_penalty=0.5)
    steps = worker.steps
    steps.launch([request], None)
    first = steps.in_flight
    steps.penalties.slots.release(["p"])  # as if the slot had been lost: the next launch takes one afresh
    steps.launch([request], first)  # its step-1 token is still on the device, fed to this step
    pending = int(first.tokens.device_tokens[0])
    sampled = int(steps.in_flight.tokens.device_tokens[0])
    want = Counter([5, pending, sampled])
    assert _slot_counts(worker, request) == [want[t] for t in range(VOCAB)]
    assert steps.penalties.slots.counted("p") == 3


def test_slots_go_back_on_abort_and_pause_and_a_resume_starts_from_its_output():
    worker = _penalized_worker()
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    aborted, paused = _running(worker, "a", max_tokens=20), _running(worker, "b", max_tokens=20)
    aborted.spec.sampling = paused.spec.sampling = params
    for _ in range(3):
        worker.step()
    slots = worker.steps.penalties.slots
    assert slots.num_used == 2
    worker._handle_messages([AbortRequest("a")])
    worker.scheduler.pause(paused)
    worker.step()
    assert slots.num_used == 0
    # a failed-over request arrives with the output its client has: its slot starts from it
    resumed = DecodeRequest(spec=dataclasses.replace(paused.spec, request_id="b.1"), output_token_ids=[5, 7, 7, 6, 4])
    worker.scheduler.add(resumed)
    worker.scheduler.waiting.remove(resumed)
    worker.scheduler.reserve(resumed)
    worker.scheduler.on_prefill_done(resumed, None, None)  # resumed: no first token
    worker.step()
    assert worker.steps.penalties.slots.counted("b.1") == 6
    assert _slot_counts(worker, resumed) == _expected_counts(worker, resumed)


def test_the_scheduler_reports_requests_that_left_the_batch():
    worker = _penalized_worker()
    ending, paused = _running(worker, "e", max_tokens=2), _running(worker, "p", max_tokens=9)
    scheduler = worker.scheduler
    scheduler.pause(paused)
    scheduler.on_step([ending], [7], [1])
    assert ending.status is RequestStatus.FINISHED
    assert sorted(scheduler.pop_left_batch()) == ["e", "p"] and scheduler.pop_left_batch() == []
    assert scheduler.pop_ended() == ["e"]  # the admission of a paused request is kept


def test_a_steady_batch_reuses_its_plan_and_a_new_member_makes_another():
    """The device tensors describing a step are made once per batch, not per step."""
    worker = _penalized_worker()
    first = _running(worker, "p", max_tokens=20)
    first.spec.sampling = SamplingParams(temperature=0.0, frequency_penalty=0.2, logit_bias=((3, 0.5),))
    worker.step()
    penalties = worker.steps.penalties
    made = penalties._plan
    worker.step()
    worker.step()
    assert penalties._plan is made
    _running(worker, "q", max_tokens=20)
    worker.step()
    assert penalties._plan is not made
