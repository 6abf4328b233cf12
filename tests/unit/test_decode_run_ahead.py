"""Run-ahead decode steps (``--decode-run-ahead``): step N+1 is launched before step
N's tokens are read, its input tokens fed from step N's on the device. The loop runs
with the fakes of ``test_decode_loop`` (the runner resolves fed tokens the way the
engine does); the engine's side is in ``tests/engine/test_engine_feed.py``."""

import pytest
import redis
import torch

from tandem.cluster.policies import MAX_UTILIZATION
from tandem.cluster.messages import GenerateRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.decode.request import DecodeRequest
from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.block_allocator import BlockAllocator
from tests.unit.test_decode_loop import _Runner, _running, _worker


class _ScriptedRunner:
    """Samples token ``script[position]`` (7 where the script says nothing)."""

    device = torch.device("cpu")

    def __init__(self, script):
        self.script, self.calls = script, []

    def forward(self, chunks, feed=None):
        tokens = [c.token_ids[0] for c in chunks]
        if feed is not None:
            tokens = [t if src < 0 else int(feed.tokens[src]) for t, src in zip(tokens, feed.rows)]
        self.calls.append(([c.num_computed for c in chunks], tokens))
        logits = torch.zeros(len(chunks), 10)
        for row, chunk in enumerate(chunks):
            logits[row, self.script.get(chunk.num_computed, 7)] = 1.0
        return logits


def test_each_step_is_launched_before_the_previous_is_read_and_fed_its_tokens():
    worker = _worker(run_ahead=True)
    # a prompt of 3 tokens: positions 3 on are decode steps
    worker.runner = worker.steps.runner = _ScriptedRunner({3: 4, 4: 6, 5: 8})
    request = _running(worker, "r1", max_tokens=6)
    worker.step()  # step 1 launched, nothing to read yet
    assert request.num_pending == 1 and worker.steps.in_flight is not None
    worker.step()  # step 2 launched first (fed step 1's token), then step 1 read
    assert len(worker.runner.calls) == 2 and request.output_token_ids == [5, 4]
    while request.status is RequestStatus.DECODING:
        worker.step()
    assert request.output_token_ids == [5, 4, 6, 8, 7, 7]
    # every step's input is the previous output token, at the next position, no step past max_tokens
    assert worker.runner.calls == [([3], [5]), ([4], [4]), ([5], [6]), ([6], [8]), ([7], [7])]
    events = worker.redis.events
    assert [e.index for e in events] == [1, 2, 3, 4, 5] and events[-1].finish_reason == "length"
    worker.step()
    assert worker.allocator.num_free == worker.allocator.num_total


def test_a_stop_token_ends_the_request_and_the_step_already_launched_is_dropped():
    worker = _worker(run_ahead=True)
    worker.runner = worker.steps.runner = _ScriptedRunner({5: 2})  # eos (2) sampled at position 5: output index 3
    request = _running(worker, "r1", max_tokens=20)
    other = _running(worker, "r2", max_tokens=20, prompt=(1, 2, 3, 4, 8, 8, 8))  # decodes from position 7 on
    num_blocks = len(request.block_ids)
    for _ in range(4):
        worker.step()
    assert request.output_token_ids == [5, 7, 7, 2] and request.finish_reason == "stop"
    # the step launched before the stop was known ran the request once more; its row was dropped
    assert [3, 4, 5, 6] == [call[0][0] for call in worker.runner.calls[:4]]
    assert worker.steps.in_flight is not None and worker.allocator.num_held == num_blocks  # freed, held for step 4
    worker.step()
    assert request.output_token_ids == [5, 7, 7, 2]  # nothing appended after the stop
    assert [e.index for e in worker.redis.events if e.request_id == "r1"] == [1, 2, 3]
    assert other.status is RequestStatus.DECODING and len(other.output_token_ids) >= 5
    while other.status is RequestStatus.DECODING:
        worker.step()
    worker.step()
    assert worker.allocator.num_free == worker.allocator.num_total


def _spec(request_id, max_tokens=50):
    return GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0),
                           max_tokens=max_tokens, reply_to="gw")


def _decoding(scheduler, request_id, max_tokens=50):
    request = DecodeRequest(spec=_spec(request_id, max_tokens))
    scheduler.add(request)
    scheduler.waiting.remove(request)
    scheduler.reserve(request)
    scheduler.on_prefill_done(request, 5, None)
    return request


def test_scheduling_ahead_grows_for_the_pending_token_and_leaves_out_requests_it_ends():
    allocator = BlockAllocator(16, 4)
    scheduler = DecodeScheduler(allocator, max_batch_size=4, max_seq_len=64, eos_token_ids=[2],
                                policy=MAX_UTILIZATION)
    ending = _decoding(scheduler, "ending", max_tokens=2)
    going = _decoding(scheduler, "going")
    assert going.num_tokens == 4 and len(going.block_ids) == 1
    for r in (ending, going):
        r.num_pending = 1  # step launched, tokens not read
    batch = scheduler.schedule_decode()
    assert batch == [going]  # "ending" reaches max_tokens with its pending token
    assert len(going.block_ids) == 2  # its next step writes position 4: a second block
    events = scheduler.on_step([ending, going], [7, 7], [1, 1])
    assert [(r.request_id, i, reason) for r, i, reason in events] == [("ending", 1, "length"), ("going", 1, None)]
    assert going.num_pending == 0


def test_no_step_is_scheduled_ahead_when_it_would_pause_a_request():
    allocator = BlockAllocator(2, 4)
    scheduler = DecodeScheduler(allocator, max_batch_size=4, max_seq_len=64, eos_token_ids=[2],
                                policy=MAX_UTILIZATION)
    first, second = _decoding(scheduler, "first"), _decoding(scheduler, "second")
    for r in (first, second):
        r.num_pending = 1  # both need a second block for their next step; none is free
    allocator.step_launched(1)
    assert not scheduler.can_schedule_ahead()
    # the loop reads the step first, then schedules as usual: the pause's blocks are free at once
    scheduler.on_step([first, second], [7, 7], [1, 1])
    allocator.step_done(1)
    assert scheduler.can_schedule_ahead() is False and scheduler.schedule_decode() == [first]
    assert second.status is RequestStatus.PAUSED and allocator.num_held == 0


def test_a_paused_request_drops_the_token_it_had_on_the_device():
    allocator = BlockAllocator(8, 4)
    scheduler = DecodeScheduler(allocator, max_batch_size=4, max_seq_len=64, eos_token_ids=[2],
                                policy=MAX_UTILIZATION)
    request = _decoding(scheduler, "r")
    request.num_pending = 1
    allocator.step_launched(1)
    scheduler.pause(request)
    assert request.num_pending == 0 and allocator.num_held == 1
    assert scheduler.on_step([request], [7], [1]) == [] and request.output_token_ids == [5]


class _HashRunner:
    """Logits from (input token, position) alone: a wrong fed token or position changes them."""

    device = torch.device("cpu")

    def forward(self, chunks, feed=None):
        tokens = [c.token_ids[0] for c in chunks]
        if feed is not None:
            tokens = [t if src < 0 else int(feed.tokens[src]) for t, src in zip(tokens, feed.rows)]
        rows = [torch.randn(10, generator=torch.Generator().manual_seed(t * 1000 + c.num_computed))
                for t, c in zip(tokens, chunks)]
        return 3 * torch.stack(rows)


def _run_to_the_end(worker, requests):
    for _ in range(100):
        if all(r.status is not RequestStatus.DECODING for r in requests) and worker.steps.in_flight is None:
            return
        worker.step()
    raise AssertionError("requests did not finish")


def test_seeded_and_greedy_outputs_are_the_same_with_and_without_run_ahead():
    outputs = {}
    for run_ahead in (False, True):
        worker = _worker(run_ahead=run_ahead)
        worker.runner = worker.steps.runner = _HashRunner()
        requests = []
        for i, sampling in enumerate([SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.7, seed=5),
                                      SamplingParams(temperature=0.0)]):
            request = _running(worker, f"r{i}", max_tokens=12 + i)
            request.spec.sampling = sampling
            requests.append(request)
        _run_to_the_end(worker, requests)
        outputs[run_ahead] = [(r.output_token_ids, r.finish_reason) for r in requests]
        assert worker.allocator.num_free == worker.allocator.num_total
    assert outputs[True] == outputs[False]
    assert len({tuple(tokens) for tokens, _ in outputs[True]}) == 3  # the rows really differ


def test_run_ahead_reads_the_step_first_when_the_next_one_would_pause_a_request():
    worker = _worker(run_ahead=True)
    worker.allocator = worker.steps.allocator = BlockAllocator(2, 4)
    worker.scheduler = DecodeScheduler(worker.allocator, max_batch_size=4, max_seq_len=64, eos_token_ids=[2],
                                       policy=MAX_UTILIZATION)
    kept, paused = _running(worker, "kept", max_tokens=20), _running(worker, "paused", max_tokens=20)
    assert worker.allocator.num_free == 0  # one block each: to go past position 3, one must be paused
    for _ in range(5):
        worker.step()
    # one pause, not two: with the guard off, the first pause's blocks would be held for the
    # step on the device and the next request paused as well
    assert worker.scheduler.num_preemptions == 1 and paused.status is RequestStatus.PAUSED
    assert kept.status is RequestStatus.DECODING and len(kept.output_token_ids) >= 4


class _FailOnCall:
    """The engine raises on its ``fail_at``-th step."""

    def __init__(self, fail_at):
        self.inner, self.fail_at, self.device = _Runner(), fail_at, torch.device("cpu")

    def forward(self, chunks, feed=None):
        if len(self.inner.calls) + 1 == self.fail_at:
            self.inner.calls.append(None)
            raise RuntimeError("engine broke")
        return self.inner.forward(chunks, feed)


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_failed_launch_keeps_the_tokens_already_computed(run_ahead):
    worker = _worker(run_ahead=run_ahead)
    worker.runner = worker.steps.runner = _FailOnCall(fail_at=2)  # step 1 runs; launching step 2 fails
    ending = _running(worker, "ending", max_tokens=2)  # token 0 from prefill, token 1 from step 1: done
    going = _running(worker, "going", max_tokens=50)
    worker.step()
    worker.step()
    assert ending.status is RequestStatus.FINISHED and ending.finish_reason == "length"
    assert going.status is RequestStatus.FAILED
    events = [(e.request_id, e.index, e.token_ids, e.finish_reason) for e in worker.redis.events]
    assert events == [("ending", 1, [7], "length"), ("going", 1, [7], None), ("going", 2, [], "error")]
    assert worker.allocator.num_free == worker.allocator.num_total


@pytest.mark.parametrize("run_ahead", [False, True])
def test_tokens_survive_a_redis_error_while_a_failed_launch_is_reported(run_ahead):
    worker = _worker(run_ahead=run_ahead)
    worker.runner = worker.steps.runner = _FailOnCall(fail_at=2)
    ending = _running(worker, "ending", max_tokens=2)
    _running(worker, "going", max_tokens=50)
    worker.step()
    worker.redis.down = True  # Redis is away in the turn whose launch fails
    with pytest.raises(redis.RedisError):
        worker.step()
    worker.redis.down = False
    worker.step()
    events = [(e.request_id, e.index, e.token_ids, e.finish_reason) for e in worker.redis.events]
    assert events == [("ending", 1, [7], "length"), ("going", 1, [7], None), ("going", 2, [], "error")]
    assert ending.output_token_ids == [5, 7]
