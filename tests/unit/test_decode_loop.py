"""The pipelined decode loop (step N+1 launched before step N's tokens are published),
with the engine, inbox and Redis replaced by small fakes: tokens survive a Redis error
in any part of a turn, and the last tokens go out without waiting on the inbox. The fakes
serve test_decode_handoffs (the prefill handoff) and test_sampled_logprobs too."""

import time
import types

import pytest
import redis
import torch

from tandem.cluster.inbox import Mailer
from tandem.cluster.messages import FIELD, AbortRequest, GenerateRequest, decode
from tandem.cluster.outputs import Outbox
from tandem.cluster.sampling import SamplingParams
from tandem.cluster.step_stats import StepStats
from tandem.decode.batch_wait import BatchWait
from tandem.decode.device_steps import DeviceSteps
from tandem.decode.request import DecodeRequest
from tandem.decode.handoffs import PrefillHandoffs
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.worker import DecodeWorker
from tandem.engine.block_allocator import BlockAllocator


class _Runner:
    device = torch.device("cpu")

    def __init__(self):
        self.calls = []  # (positions, input tokens) per step, fed tokens resolved

    def forward(self, chunks, feed=None):
        tokens = [c.token_ids[0] for c in chunks]
        if feed is not None:
            tokens = [t if src < 0 else int(feed.tokens[src]) for t, src in zip(tokens, feed.rows)]
        self.calls.append(([c.num_computed for c in chunks], tokens))
        return torch.zeros(len(chunks), 10).index_fill_(1, torch.tensor([7]), 1.0)  # always token 7


class _Inbox:
    def __init__(self):
        self.fail, self.reads = False, []

    def read(self, block_ms=None):
        self.reads.append(block_ms)
        if self.fail:
            raise redis.ConnectionError("redis is down")
        return []


class _Redis:
    """Just enough of a client for Outbox: pipelines of XADD that fail while ``down``."""

    def __init__(self):
        self.down, self.events, self.sent, self.hashes = False, [], [], {}

    def hgetall(self, key):  # drain marks (cluster.draining)
        return self.hashes.get(key, {})

    def xadd(self, stream, fields, **_):  # a control message (cluster.inbox.send)
        if self.down:
            raise redis.ConnectionError("redis is down")
        self.sent.append((stream, decode(fields[FIELD])))

    def pipeline(self, transaction=False):
        client, queued = self, []

        class Pipe:
            def xadd(self, stream, fields, **_):
                queued.append(fields[FIELD])

            def execute(self):
                if client.down:
                    raise redis.ConnectionError("redis is down")
                client.events += [e for data in queued for e in decode(data).unpack()]

        return Pipe()


def _worker(run_ahead=False):
    worker = object.__new__(DecodeWorker)
    worker.run_ahead = run_ahead
    worker.allocator = BlockAllocator(64, 4)
    worker.scheduler = DecodeScheduler(worker.allocator, max_batch_size=4, max_seq_len=64, eos_token_ids=[2])
    worker.runner, worker.inbox = _Runner(), _Inbox()
    worker.redis = _Redis()
    worker.outbox = Outbox(worker.redis)
    worker.mailer, worker._unhandled, worker._early_aborts = Mailer(worker.redis), [], {}
    worker.policies = types.SimpleNamespace(
        refresh=lambda: types.SimpleNamespace(capacity_scheduler_policy=worker.scheduler.policy.name))
    worker.stats = StepStats("decode", 1e9)
    worker.steps = DeviceSteps(worker.runner, worker.allocator, worker.stats)
    worker.batch_wait = BatchWait(0.2, 4)
    worker.handoffs = PrefillHandoffs(
        settings=types.SimpleNamespace(transfer_timeout_s=300.0, model_name="m", enable_prefix_caching=False),
        worker_id="d0", redis=worker.redis, scheduler=worker.scheduler,
        transport=types.SimpleNamespace(revoke_stops_writes=False),  # as shm and cuda_ipc
        kv_endpoint={}, mailer=worker.mailer, publish=worker._publish)
    # the turn's Redis-facing handoff work is off (tests that need it delete these)
    worker.handoffs.refresh_peers, worker.handoffs.dispatch = (lambda: False), (lambda: None)
    worker.handoffs.check = worker._release_admissions = lambda: None
    return worker


def _running(worker, request_id, max_tokens, prompt=(1, 2, 3)):
    spec = GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt), sampling=SamplingParams(temperature=0.0),
                           max_tokens=max_tokens, reply_to="gw")
    request = DecodeRequest(spec=spec)
    worker.scheduler.add(request)
    worker.scheduler.waiting.remove(request)
    worker.scheduler.reserve(request)
    worker.scheduler.on_prefill_done(request, 5, None)  # the prefill worker published token 0
    return request


def _turn(worker):
    try:
        worker.step()
    except redis.RedisError:
        pass  # run_steps logs it and goes on with the next turn


def test_tokens_survive_a_redis_error_after_they_were_recorded():
    worker = _worker()
    request = _running(worker, "r1", max_tokens=8)
    for _ in range(3):
        _turn(worker)
    worker.inbox.fail = worker.redis.down = True  # the turn that records step 3 loses Redis
    _turn(worker)
    _turn(worker)
    worker.inbox.fail = worker.redis.down = False
    for _ in range(6):
        _turn(worker)
    indices = [e.index for e in worker.redis.events]
    assert request.output_token_ids == [5] + [7] * 7
    assert sorted(set(indices)) == list(range(1, 8))  # every step's tokens reached Redis, in order
    assert indices == sorted(indices)
    assert worker.redis.events[-1].finish_reason == "length"


def test_the_last_tokens_go_out_before_the_loop_waits_on_its_inbox():
    worker = _worker()
    _running(worker, "r1", max_tokens=3)
    while not any(e.finish_reason for e in worker.redis.events):
        worker.step()
    # the turn that recorded the finishing step did not block on the inbox first
    assert worker.inbox.reads[-1] is None
    worker.step()
    assert worker.inbox.reads[-1] == 20  # idle now: the loop waits for work


def test_a_resumed_request_with_nothing_left_ends_at_once():
    worker = _worker()
    worker.settings = types.SimpleNamespace(max_seq_len=64)
    worker._ended_ids = []
    spec = GenerateRequest(request_id="r9.1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0),
                           max_tokens=4, reply_to="gw", output_token_ids=[5, 6, 7, 8])
    worker._handle_messages([spec])
    assert "r9.1" not in worker.scheduler.requests and worker._ended_ids == ["r9.1"]
    (event,) = worker.redis.events
    assert (event.index, event.token_ids, event.finish_reason) == (4, [], "length")
    resumed = GenerateRequest(request_id="r10.1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0),
                              max_tokens=8, reply_to="gw", output_token_ids=[5, 6])
    worker._handle_messages([resumed])
    request = worker.scheduler.requests["r10.1"]
    assert request.output_token_ids == [5, 6] and request.is_resuming


@pytest.mark.parametrize("run_ahead", [False, True])
def test_an_abort_for_the_step_on_the_device_frees_blocks_only_after_it(run_ahead):
    from tandem.cluster.messages import AbortRequest

    worker = _worker(run_ahead)
    request = _running(worker, "r1", max_tokens=50)
    worker.step()  # launches step 1
    assert worker.steps.in_flight is not None
    worker._handle_messages([AbortRequest("r1")])
    assert "r1" not in worker.scheduler.requests  # ended at once
    assert worker.allocator.num_free < worker.allocator.num_total  # but its blocks wait for the step
    assert worker.allocator.num_held == worker.allocator.num_total - worker.allocator.num_free
    worker.step()  # reads the step back: its row is dropped, the blocks go free
    assert request.output_token_ids == [5]
    assert worker.allocator.num_free == worker.allocator.num_total and worker.allocator.num_held == 0


def test_a_step_sharing_the_gpu_waits_for_requests_in_prefill_but_not_past_the_limit():
    from tandem.decode.worker import HOLD_POLL_MS

    worker = _worker()
    worker.batch_wait = BatchWait(0.05, 4)
    worker.batch_wait.shared = True  # a prefill worker computes on the same GPU
    request = _running(worker, "r1", max_tokens=50)
    joining = DecodeRequest(spec=GenerateRequest(
        request_id="r2", prompt_token_ids=[1, 2], sampling=SamplingParams(temperature=0.0), max_tokens=8, reply_to="gw"))
    worker.scheduler.add(joining)
    worker.scheduler.waiting.remove(joining)
    worker.scheduler.reserve(joining)  # its prefill is under way
    joining.dispatched_at = time.monotonic()
    worker.step()
    assert worker.steps.in_flight is None and worker.inbox.reads[-1] == HOLD_POLL_MS  # held: waits on the inbox
    assert len(request.output_token_ids) == 1
    time.sleep(0.06)
    worker.step()  # held long enough: the step goes without the joiner
    assert worker.steps.in_flight is not None and [r.request_id for r in worker.steps.in_flight.batch] == ["r1"]
    worker.step()  # collects it; held again
    assert len(request.output_token_ids) == 2 and worker.steps.in_flight is None
    worker.scheduler.on_prefill_done(joining, 5, None)  # the joiner arrives: nothing left to wait for
    worker.step()
    assert [r.request_id for r in worker.steps.in_flight.batch] == ["r1", "r2"]


def _prefilling(worker, request_id, prefill_worker_id="p0", started_at=1.0):
    spec = GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(),
                           max_tokens=4, reply_to="gw")
    request = DecodeRequest(spec=spec)
    worker.scheduler.add(request)
    worker.scheduler.waiting.remove(request)
    worker.scheduler.reserve(request)
    request.prefill_worker_id, request.prefill_started_at = prefill_worker_id, started_at
    return request


def test_messages_a_redis_error_cut_off_are_handled_next_turn():
    """Inbox reads are NOACK: what a Redis error stops the worker from handling in one turn is
    handled in the next, and the abort it was forwarding goes out once Redis is back."""
    worker = _worker()
    _prefilling(worker, "r1")
    new = GenerateRequest(request_id="r2", prompt_token_ids=[1], sampling=SamplingParams(), max_tokens=2,
                          reply_to="gw")
    worker.redis.down = True
    with pytest.raises(redis.RedisError):  # forwarding r1's abort to its prefill worker fails
        worker._handle_messages([AbortRequest("r1"), new])
    assert "r2" not in worker.scheduler.requests and worker._unhandled == [new]
    worker.redis.down = False
    worker._handle_messages([])
    assert "r2" in worker.scheduler.requests and worker._unhandled == []
    worker.mailer.flush()
    assert [(stream, m.request_id) for stream, m in worker.redis.sent] == [("tandem:inbox:prefill:p0", "r1")]


def test_an_aborted_request_ends_its_stream_with_abort():
    """An admin cancel reaches the worker as an abort: the client's stream must end too."""
    worker = _worker()
    request = _running(worker, "r1", max_tokens=10)
    request.output_token_ids += [7, 7]
    worker._handle_messages([AbortRequest("r1", "cancelled")])
    assert "r1" not in worker.scheduler.requests and worker.redis.events == []  # kept for the turn's flush
    worker.outbox.flush()
    (event,) = worker.redis.events
    assert (event.request_id, event.index, event.token_ids, event.finish_reason) == ("r1", 3, [], "abort")
    worker._handle_messages([AbortRequest("unknown")])
    worker.outbox.flush()
    assert len(worker.redis.events) == 1


def test_an_abort_that_overtakes_its_request_ends_the_request_on_arrival():
    """The admin API can cancel a request between the gateway's admission and its submission:
    the abort reaches the inbox first, and the request must not then run to its end."""
    worker = _worker()
    worker._ended_ids = []
    late = GenerateRequest(request_id="r9", prompt_token_ids=[1, 2], sampling=SamplingParams(), max_tokens=8,
                           reply_to="gw")
    worker._handle_messages([AbortRequest("r9", "cancelled"), late])
    assert "r9" not in worker.scheduler.requests and worker._ended_ids == ["r9"]  # its admission given back
    worker.outbox.flush()
    (event,) = worker.redis.events
    assert (event.request_id, event.index, event.finish_reason) == ("r9", 0, "abort")
    worker._handle_messages([GenerateRequest(request_id="r9", prompt_token_ids=[1], sampling=SamplingParams(),
                                             max_tokens=2, reply_to="gw")])
    assert "r9" in worker.scheduler.requests  # remembered once, not for ever
