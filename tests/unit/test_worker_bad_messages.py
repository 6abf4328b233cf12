"""Inbox entries that are no valid message, and valid ones a worker cannot run, never crash a
worker: with the engine, transport and Redis replaced by small fakes (the decode worker's from
test_decode_loop), arbitrary entries go through the decode and prefill workers' message handling;
nothing raises, a dropped message leaves the worker as it was, a request or job it names is
failed (the client gets an error event, the decode worker a PrefillDone "failed"), and a valid
request afterwards still runs to its end."""

from __future__ import annotations

import types

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.cluster.inbox import Mailer, read_entry
from tandem.cluster.messages import (
    FIELD, AbortRequest, GenerateRequest, MessageError, PrefillDone, PrefillJob, decode, encode,
)
from tandem.cluster.outputs import Outbox
from tandem.cluster.sampling import SamplingParams
from tandem.cluster.step_stats import StepStats
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.kvtransfer import KVReceiver
from tandem.kvtransfer.base import CompletedTransfer, Connection
from tandem.prefill.scheduler import PrefillScheduler
from tandem.engine.guide import Guides
from tandem.prefill.worker import PrefillWorker
from tests.unit.test_decode_loop import _prefilling, _Redis, _worker

EXAMPLES = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
VOCAB = 10  # the fake runners' logits
REPLY_TO = "tandem:out:gw:g0"

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=6),
                    st.binary(max_size=6))
wild = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c,
                                                                                          max_size=3)), max_leaves=8)


def _spoiled(template: dict):
    """The template's map with some fields replaced by anything and some left out; never valid."""
    names = sorted(template)
    return st.tuples(st.fixed_dictionaries({}, optional={n: wild for n in names}),
                     st.sets(st.sampled_from(names), max_size=3)).map(
        lambda spoil: {k: v for k, v in {**template, **spoil[0]}.items() if k not in spoil[1]},
    ).filter(lambda body: _invalid(msgpack.packb(body, use_bin_type=True)))


def _invalid(raw: bytes) -> bool:
    try:
        decode(raw)
    except MessageError:
        return True
    return False


def _map(msg) -> dict:
    return msg if isinstance(msg, dict) else msgpack.unpackb(encode(msg), raw=False)


def _entries(*templates):
    """Raw inbox entries that do not decode: spoiled messages, and bytes that are none."""
    maps = st.one_of(*(_spoiled(_map(t)) for t in templates)).map(lambda b: msgpack.packb(b, use_bin_type=True))
    return st.lists(st.one_of(maps, st.binary(max_size=40).filter(_invalid)), min_size=1, max_size=6)


def _named(body, name):
    value = body.get(name) if isinstance(body, dict) else None
    return value if isinstance(value, str) and value else None


def _body(raw: bytes):
    try:
        return msgpack.unpackb(raw, raw=False)
    except Exception:
        return None


def _read(raws: list[bytes]) -> list:
    """What the inbox hands the worker for these entries."""
    return [m for m in (read_entry(b"0-%d" % i, {FIELD: raw}) for i, raw in enumerate(raws)) if m is not None]


# ---- decode worker ----------------------------------------------------------------------------

def _decode_worker():
    worker = _worker()
    worker.settings = types.SimpleNamespace(max_seq_len=64)
    worker._ended_ids = []
    worker.vocab_size = VOCAB
    return worker


REQUEST = GenerateRequest("new", [1, 2, 3], SamplingParams(temperature=0.0), 4, reply_to=REPLY_TO)
AFTER = GenerateRequest("after-the-garbage", [1, 2, 3], SamplingParams(temperature=0.0), 4, reply_to=REPLY_TO)
DONE = PrefillDone("pre", "ok", 5, prefill_worker_id="p0", handoff_id="pre#1")


def _snapshot(worker):
    s = worker.scheduler
    return (sorted(s.requests), [r.request_id for r in s.waiting], sorted(s.prefilling),
            [r.request_id for r in s.running], worker.allocator.num_free, worker.mailer.num_pending)


def _run_to_the_end(worker, request_id: str) -> list:
    """A request just handled: through its (faked) prefill handoff, then worker.step() to its end."""
    assert request_id in worker.scheduler.requests
    (request,) = worker.scheduler.schedule_prefills()
    request.receiver, request.prefill_worker_id, request.dispatch_id = KVReceiver(300.0), "p0", f"{request_id}#9"
    worker._handle_messages([PrefillDone(request_id, "ok", 5, prefill_worker_id="p0", handoff_id=f"{request_id}#9")])
    for _ in range(20):
        worker.step()
        if any(e.request_id == request_id and e.finish_reason for e in worker.redis.events):
            break
    return [e for e in worker.redis.events if e.request_id == request_id]


@EXAMPLES
@given(_entries(REQUEST, DONE, AbortRequest("pre"), dict(_map(REQUEST), kind="NoSuchKind")))
def test_decode_worker_survives_invalid_entries_and_still_serves(raws):
    worker = _decode_worker()
    pending = _prefilling(worker, "pre")
    pending.receiver, pending.dispatch_id = KVReceiver(300.0), "pre#1"
    before = _snapshot(worker)

    worker._handle_messages(_read(raws))  # raises nothing

    assert _snapshot(worker) == before  # nothing taken, nothing freed
    bodies = [_body(raw) for raw in raws]
    refused = [(_named(b, "request_id"), _named(b, "reply_to")) for b in bodies if _named(b, "kind") == "GenerateRequest"
               and _named(b, "request_id") not in (None, "pre") and _named(b, "reply_to")]
    queued = worker.outbox._pending  # the error events, to their requests' reply streams
    assert [(e.request_id, stream) for stream, e in queued] == refused
    assert all(e.finish_reason == "error" and e.error.startswith("invalid request") for _s, e in queued)
    assert worker._ended_ids == [r for r, _ in refused]  # their admissions are given back
    # a broken PrefillDone for the handoff in flight fails it (the check ends it); any other is ignored
    hits = any(_named(b, "kind") == "PrefillDone" and _named(b, "request_id") == "pre"
               and _named(b, "handoff_id") == "pre#1" for b in bodies)
    assert (pending.receiver.poll().value == "failed") == hits

    worker._handle_messages([AFTER])
    events = _run_to_the_end(worker, AFTER.request_id)
    assert events[-1].finish_reason == "length" and [t for e in events for t in e.token_ids] == [7, 7, 7]


@pytest.mark.parametrize("change, error", [
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"request_id": "r-list", "sampling": {"temperature": "hot"}}, "temperature"),
    ({"stop_token_ids": None}, "stop_token_ids"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
])
def test_a_bad_generate_request_gets_an_error_event_on_its_reply_stream(change, error):
    worker = _decode_worker()
    worker._handle_messages(_read([msgpack.packb({**_map(REQUEST), **change}, use_bin_type=True)]))
    assert worker.scheduler.requests == {}
    worker.outbox.flush()
    (event,) = worker.redis.events
    assert (event.request_id, event.finish_reason) == (change.get("request_id", "new"), "error") and error in event.error


@pytest.mark.parametrize("request_, error", [
    (GenerateRequest("long", [1] * 64, SamplingParams(), 4, reply_to=REPLY_TO), "max_seq_len"),
    (GenerateRequest("vocab", [1, VOCAB], SamplingParams(), 4, reply_to=REPLY_TO), "vocabulary"),
    (GenerateRequest("resumed", [1], SamplingParams(), 4, reply_to=REPLY_TO, output_token_ids=[3, 99]), "vocabulary"),
    # well-formed, and past the context: it would hold max_seq_len's blocks for nothing
    (GenerateRequest("huge", [1, 2, 3], SamplingParams(), 10**12, reply_to=REPLY_TO), "max_tokens 1000000000000"),
    (GenerateRequest("over", [1] * 60, SamplingParams(), 5, reply_to=REPLY_TO), "exceed this worker's max_seq_len 64"),
])
def test_a_request_beyond_the_workers_limits_is_refused_not_queued(request_, error):
    worker = _decode_worker()
    worker._handle_messages([request_])
    assert worker.scheduler.requests == {} and worker._ended_ids == [request_.request_id]
    worker.outbox.flush()
    (event,) = worker.redis.events
    assert event.finish_reason == "error" and error in event.error


def test_a_first_token_outside_the_vocabulary_fails_the_request():
    worker = _decode_worker()
    request = _prefilling(worker, "pre")
    request.receiver, request.dispatch_id = KVReceiver(300.0), "pre#1"
    worker._handle_messages([PrefillDone("pre", "ok", VOCAB, prefill_worker_id="p0", handoff_id="pre#1")])
    assert "pre" not in worker.scheduler.requests and worker.allocator.num_free == worker.allocator.num_total
    (event,) = worker.redis.events
    assert event.finish_reason == "error" and "vocabulary" in event.error


def test_an_error_while_handling_a_request_fails_it_and_the_worker_goes_on(monkeypatch):
    worker = _decode_worker()
    monkeypatch.setattr(worker.scheduler, "add", lambda request: 1 / 0)
    worker._handle_messages([REQUEST, AbortRequest("other")])
    assert "other" in worker._early_aborts  # the next message was handled
    worker.outbox.flush()
    (event,) = worker.redis.events
    assert event.finish_reason == "error" and "division" in event.error


# ---- prefill worker ---------------------------------------------------------------------------

class _PrefillRunner:
    device = torch.device("cpu")
    config = types.SimpleNamespace(vocab_size=VOCAB)

    def __init__(self, num_blocks: int, block_size: int):
        self.kv_pool = types.SimpleNamespace(kv=torch.zeros(1, 2, num_blocks, block_size, 1, 2))

    def forward(self, seqs):
        return torch.zeros(len(seqs), VOCAB).index_fill_(1, torch.tensor([7]), 1.0)  # always token 7

    def handoff_kv(self):
        return self.kv_pool.kv


class _Connection(Connection):
    def __init__(self, endpoint):
        self.writes = []

    def write(self, src_kv, src_block_ids, dst_block_ids, handoff_id=None):
        self.writes.append(list(dst_block_ids))
        return CompletedTransfer()


def _prefill_worker(connect=_Connection):
    worker = object.__new__(PrefillWorker)
    worker.settings = types.SimpleNamespace(max_seq_len=64)
    worker.worker_id, worker.block_size = "p0", 4
    worker.allocator = BlockAllocator(32, 4)
    worker.prefix_cache = PrefixCache(worker.allocator, enabled=False)
    worker.scheduler = PrefillScheduler(worker.allocator, max_num_tokens=8, max_batch_size=4,
                                        prefix_cache=worker.prefix_cache)
    worker.runner = _PrefillRunner(32, 4)
    worker.transport = types.SimpleNamespace(connect=connect)
    worker.eos_token_ids = [2]
    worker.guides = Guides("unused: no request here is guided", 32, [2])
    worker.redis = _Redis()
    worker.inbox = types.SimpleNamespace(read=lambda block_ms=None: [])
    worker.outbox, worker.mailer = Outbox(worker.redis), Mailer(worker.redis)
    worker.policies = types.SimpleNamespace(
        refresh=lambda: types.SimpleNamespace(context_chunking_policy=worker.scheduler.policy.name))
    worker._connections, worker._pool_of, worker._deferred = {}, {}, {}
    worker.prefix_index = None
    worker.stats = StepStats("prefill", 1e9)
    return worker


ENDPOINT = {"transport": "fake", "path": "/dev/shm/pool", "layout": {"num_blocks": 16}}
JOB = PrefillJob("job", [1, 3, 4, 5, 6, 1, 3], SamplingParams(temperature=0.0), 4, [3, 4], ENDPOINT, "decode-0",
                 reply_to=REPLY_TO, handoff_id="job#1")


def _replies(worker) -> list[PrefillDone]:
    return [m for stream, m in worker.redis.sent if isinstance(m, PrefillDone)]


def _run_job(worker, job: PrefillJob) -> PrefillDone:
    worker._handle_messages([job])
    for _ in range(10):
        worker.step()
        done = [m for m in _replies(worker) if m.request_id == job.request_id]
        if done:
            return done[-1]
    raise AssertionError("the job never finished")


@EXAMPLES
@given(_entries(JOB, AbortRequest("job")))
def test_prefill_worker_survives_invalid_entries_and_still_serves(raws):
    worker = _prefill_worker()
    worker._handle_messages(_read(raws))  # raises nothing

    assert worker.scheduler.jobs == {} and worker.allocator.num_free == worker.allocator.num_total
    assert worker._connections == {} and worker.redis.events == []
    bodies = [_body(raw) for raw in raws]
    answered = [(_named(b, "request_id"), _named(b, "decode_worker_id")) for b in bodies
                if _named(b, "kind") == "PrefillJob" and _named(b, "request_id") and _named(b, "decode_worker_id")]
    sent = [(m.request_id, stream) for stream, m in worker.redis.sent]
    assert sent == [(r, f"tandem:inbox:decode:{d}") for r, d in answered]
    assert all(m.status == "failed" and m.error.startswith("invalid PrefillJob") for m in _replies(worker))

    worker.redis.sent.clear()
    done = _run_job(worker, JOB)
    assert (done.status, done.first_token, done.handoff_id) == ("ok", 7, "job#1")
    assert worker.redis.events[-1].token_ids == [7]


@pytest.mark.parametrize("change, error", [
    ({"dst_block_ids": [3, 16]}, "outside the decode worker's pool of 16"),
    ({"prompt_token_ids": [1, VOCAB]}, "vocabulary"),
    ({"prompt_token_ids": [1] * 64}, "max_seq_len"),
    ({"prompt_token_ids": [1] * 63, "max_tokens": 1, "dst_block_ids": list(range(16))},
     "exceed this prefill worker's KV pool"),
    ({"max_tokens": 10**12}, "max_tokens 1000000000000 exceed max_seq_len 64"),
    ({"dst_block_ids": [3]}, "1 destination blocks cannot hold the prompt's 7 tokens"),
])
def test_a_job_beyond_the_workers_limits_is_failed_at_once(change, error):
    from dataclasses import replace

    worker = _prefill_worker()
    worker.allocator = BlockAllocator(8, 4)  # 32 tokens
    worker._handle_messages([replace(JOB, **change)])
    assert worker.scheduler.jobs == {} and worker._connections == {}
    (done,) = _replies(worker)
    assert done.status == "failed" and error in done.error and done.handoff_id == "job#1"


def test_a_kv_write_that_raises_fails_its_job_not_the_worker():
    """A copy's own error (here an index the destination lacks) is no TransferError: it used to
    escape the prefill step and end the process."""

    class Broken(_Connection):
        def write(self, src_kv, src_block_ids, dst_block_ids, handoff_id=None):
            raise IndexError("index 40 is out of bounds for dimension 2 with size 16")

    worker = _prefill_worker(connect=Broken)
    done = _run_job(worker, JOB)
    assert done.status == "failed" and "out of bounds" in done.error
    assert worker.scheduler.jobs == {} and worker.allocator.num_free == worker.allocator.num_total
    worker.transport.connect = _Connection
    worker._connections.clear()
    assert _run_job(worker, PrefillJob(**{**JOB.__dict__, "request_id": "next"})).status == "ok"


def test_an_endpoint_the_worker_cannot_use_fails_the_job():
    worker = _prefill_worker()
    bad = PrefillJob(**{**JOB.__dict__, "kv_endpoint": {"path": ["not", "hashable"]}})
    worker._handle_messages([bad, AbortRequest("other")])
    (done,) = _replies(worker)
    assert done.status == "failed" and worker.scheduler.jobs == {}


def test_a_finished_handoff_is_reported_before_its_first_token_goes_out():
    """With writes that are done at once (shm), PrefillDone reaches the decode worker before the
    client can have the first token: should the prefill worker die right after, its decode worker
    has the first token and never computes the prompt again."""
    worker = _prefill_worker()
    order = []
    xadd, pipeline = worker.redis.xadd, worker.redis.pipeline

    def logged_xadd(stream, fields, **kw):
        order.append("PrefillDone")
        return xadd(stream, fields, **kw)

    def logged_pipeline(transaction=False):
        pipe = pipeline(transaction)
        execute = pipe.execute
        pipe.execute = lambda: (order.append("first token"), execute())
        return pipe

    worker.redis.xadd, worker.redis.pipeline = logged_xadd, logged_pipeline
    done = _run_job(worker, JOB)
    assert done.status == "ok" and worker.redis.events[-1].token_ids == [7]
    assert order == ["PrefillDone", "first token"]
