"""The decode worker's side of the prefill handoff (tandem.decode.handoffs), with the engine, inbox and
Redis replaced by the small fakes of test_decode_loop: lost and restarted prefill workers, the
blocks a lost worker may still write (tandem.decode.quarantine), stale replies, and the prefill worker's
answer to a job sent back to it."""

import types

import pytest

from tandem.cluster.messages import PrefillDone, WorkerInfo
from tests.unit.test_decode_loop import _prefilling, _worker


def test_a_prefill_worker_restarted_under_its_id_counts_as_lost(monkeypatch):
    """Its new process never saw the job (NOACK inbox): the request is re-dispatched at once
    instead of waiting out its transfer timeout."""
    import tandem.decode.handoffs as worker_module

    worker = _worker()
    del worker.handoffs.refresh_peers  # the real one
    same, restarted = _prefilling(worker, "same", "p0", 1.0), _prefilling(worker, "restarted", "p1", 1.0)
    gone = _prefilling(worker, "gone", "p2", 1.0)
    worker.handoffs.settings = types.SimpleNamespace(model_name="m")
    peers = [types.SimpleNamespace(worker_id="p0", started_at=1.0, device="cpu", model="m"),
             types.SimpleNamespace(worker_id="p1", started_at=2.0, device="cpu", model="m"),  # p1 restarted
             types.SimpleNamespace(worker_id="p2", started_at=1.0, device="cpu", model="other", role="prefill")]  # p2: not ours
    monkeypatch.setattr(worker_module, "live_workers", lambda client, role: peers)
    monkeypatch.setattr(worker_module, "ended_runs", lambda client, role, workers: set())
    redispatched = []
    worker.handoffs._send_prefill_job = redispatched.append
    worker.handoffs._peers_checked_at = 0.0
    worker.handoffs.refresh_peers()
    assert redispatched == []  # found lost, re-dispatched after the turn's inbox read
    worker.handoffs.redispatch_lost()
    assert redispatched == [restarted, gone] and same not in redispatched
    assert sorted(m.request_id for _s, m in worker.handoffs.redis.sent) == ["gone", "restarted"]  # the old jobs aborted


def test_a_lost_prefill_workers_blocks_are_held_until_it_is_done_with_them(monkeypatch):
    """shm and cuda_ipc write the decode pool directly: a prefill worker taken for lost may only
    be frozen and still write its chunk. The redo gets fresh blocks; the old ones stay out of use
    until that worker's PrefillDone (or its end), never handed to another request meanwhile."""
    import tandem.decode.handoffs as worker_module

    worker = _worker()
    del worker.handoffs.refresh_peers  # the real one
    worker.handoffs.settings = types.SimpleNamespace(model_name="m")
    request = _prefilling(worker, "r1", "p0", 1.0)
    old_blocks = list(request.block_ids)
    free_before = worker.allocator.num_free
    peers = [types.SimpleNamespace(worker_id="p1", started_at=1.0, device="cpu", model="m")]  # p0's beats lapsed
    monkeypatch.setattr(worker_module, "live_workers", lambda client, role: peers)
    monkeypatch.setattr(worker_module, "ended_runs", lambda client, role, workers: set())
    redispatched = []
    worker.handoffs._send_prefill_job = lambda r: (redispatched.append(r), setattr(r, "prefill_worker_id", "p1"))
    worker.handoffs._peers_checked_at = 0.0
    worker.handoffs.refresh_peers()
    worker.handoffs.redispatch_lost()
    assert redispatched == [request] and request.block_ids and not set(request.block_ids) & set(old_blocks)
    assert worker.handoffs.quarantine.num_blocks == len(old_blocks)
    assert worker.allocator.num_free == free_before - len(old_blocks)  # the old ones are not free
    worker.handoffs.on_prefill_done(PrefillDone("r1", "aborted", prefill_worker_id="p0"))  # p0 woke, stopped
    assert worker.handoffs.quarantine.num_blocks == 0 and worker.allocator.num_free == free_before
    assert "r1" in worker.scheduler.prefilling  # the redo goes on (p0's reply is stale for it)


def test_a_failed_handoff_holds_its_blocks_until_the_worker_is_seen_to_have_restarted(monkeypatch):
    import tandem.decode.handoffs as worker_module
    from tandem.kvtransfer import KVReceiver

    worker = _worker()
    del worker.handoffs.refresh_peers, worker.handoffs.check
    worker.handoffs.settings = types.SimpleNamespace(model_name="m")
    worker.handoffs._end_handoff = lambda request: None
    request = _prefilling(worker, "r1", "p0", 1.0)
    request.receiver = KVReceiver(timeout_s=300.0)
    request.receiver.fail("kv handoff timed out")
    free_before = worker.allocator.num_free
    worker.handoffs.check()
    assert "r1" not in worker.scheduler.requests and worker.allocator.num_free == free_before  # held
    peers = [types.SimpleNamespace(worker_id="p0", started_at=2.0, device="cpu", model="m")]  # a new run
    monkeypatch.setattr(worker_module, "live_workers", lambda client, role: peers)
    monkeypatch.setattr(worker_module, "ended_runs", lambda client, role, workers: set())
    worker.handoffs._peers_checked_at = 0.0
    worker.handoffs.refresh_peers()
    worker.handoffs.redispatch_lost()
    assert worker.handoffs.quarantine.num_blocks == 0 and worker.allocator.num_free > free_before


def test_with_a_transport_that_stops_late_writes_nothing_is_held():
    from tandem.kvtransfer import KVReceiver

    worker = _worker()
    del worker.handoffs.check
    worker.handoffs.transport = types.SimpleNamespace(revoke_stops_writes=True)  # nccl: grants
    worker.handoffs._end_handoff = lambda request: None
    request = _prefilling(worker, "r1", "p0", 1.0)
    request.receiver = KVReceiver(timeout_s=300.0)
    request.receiver.fail("kv handoff timed out")
    free_before, held = worker.allocator.num_free, len(request.block_ids)
    worker.handoffs.check()
    assert worker.handoffs.quarantine.num_blocks == 0 and worker.allocator.num_free == free_before + held



def test_a_prefill_pid_is_trusted_only_within_this_pid_namespace():
    """Containers can share a hostname (and /dev/shm or a GPU) but not a PID namespace: there a
    prefill worker's pid says nothing about its process here, and held blocks must wait."""
    import os

    from tandem.cluster.process import pid_namespace

    worker = _worker()
    worker.handoffs._pid_namespace = pid_namespace()
    worker.handoffs.redis = types.SimpleNamespace(xadd=lambda *a, **k: None)
    worker.handoffs.transport = types.SimpleNamespace(grant=lambda *a: None, revoke_stops_writes=False)
    worker.handoffs._end_handoff, worker.handoffs._cached_prefixes = (lambda request: None), (lambda request, workers: {})
    worker.handoffs._round_robin, worker.handoffs._handoff_seq = 0, 0
    worker.handoffs.settings = types.SimpleNamespace(transfer_timeout_s=300.0)
    worker.handoffs.kv_endpoint, worker.handoffs.worker_id = {}, "decode-0"

    def dispatch(namespace):
        request = _prefilling(worker, f"r{namespace}", None, None)
        worker.handoffs._prefill_workers = [WorkerInfo("p0", "prefill", "m", "inbox", 4242, os.uname().nodename, 1.0, 1.0, 8, 8,
                                              pid_namespace=namespace)]
        worker.handoffs._taking_prefill_workers = worker.handoffs._prefill_workers
        worker.handoffs._send_prefill_job(request)
        return request.prefill_pid

    assert dispatch(worker.handoffs._pid_namespace) == 4242
    assert dispatch(worker.handoffs._pid_namespace + 1) is None
    assert dispatch(0) is None


def test_a_reply_to_an_earlier_dispatch_is_stale_even_from_the_same_worker():
    """A request can come back to the worker it was first sent to (taken from it while its beats
    lapsed, then from the next one): that worker's reply to the first, aborted job must not end
    the second. Each PrefillDone names the job (handoff id) it answers."""
    from tandem.kvtransfer import KVReceiver
    from tandem.prefill.worker import PrefillWorker

    worker = _worker()
    worker.handoffs.settings = types.SimpleNamespace(transfer_timeout_s=300.0, enable_prefix_caching=False)
    worker.handoffs.transport = types.SimpleNamespace(revoke_stops_writes=False, grant=lambda *a: None, revoke=lambda *a: None)
    worker.handoffs.kv_endpoint, worker.handoffs.worker_id, worker.handoffs._round_robin, worker.handoffs._pid_namespace = {}, "d0", 0, "ns"
    p0 = types.SimpleNamespace(worker_id="p0", started_at=1.0, host="elsewhere", pid_namespace="", pid=1,
                               inbox="tandem:inbox:prefill:p0", num_waiting=0, num_running=0)
    worker.handoffs._taking_prefill_workers = worker.handoffs._prefill_workers = [p0]
    request = _prefilling(worker, "r1", None)
    worker.handoffs._send_prefill_job(request)  # the first job ...
    worker.handoffs._send_prefill_job(request)  # ... and, after two re-dispatches, the same worker's second
    first, second = [m for _stream, m in worker.handoffs.redis.sent]
    assert first.handoff_id != second.handoff_id and request.prefill_worker_id == "p0"

    sender = object.__new__(PrefillWorker)  # the prefill side echoes each job's handoff id
    sender.worker_id, replies = "p0", []
    sender.mailer = types.SimpleNamespace(send=lambda stream, msg: replies.append(msg))
    for job, status in ((first, "aborted"), (second, "ok")):
        sender._reply(types.SimpleNamespace(job=job, first_token=5, finish_reason=None), status)
    stale, answer = replies
    assert stale.handoff_id == first.handoff_id and answer.handoff_id == second.handoff_id

    worker.handoffs.on_prefill_done(stale)
    assert "r1" in worker.scheduler.prefilling  # still waiting for the second job
    request.receiver = KVReceiver(timeout_s=300.0)
    worker.handoffs.on_prefill_done(answer)
    assert "r1" not in worker.scheduler.prefilling and request.output_token_ids == [5]


def test_a_job_sent_back_to_a_prefill_worker_still_draining_its_first_waits_for_it():
    """The re-dispatched job reaches the worker while the first, aborted one still drains its
    writes (same request id): it is taken once the first is gone, not dropped as a duplicate
    (its decode side would wait out the transfer timeout); an abort then ends it at once."""
    from tandem.prefill.worker import PrefillWorker
    from tandem.cluster.request_state import RequestStatus as PrefillStatus

    first = types.SimpleNamespace(request_id="r1", handoff_id="r1#1", decode_worker_id="d0")
    second = types.SimpleNamespace(request_id="r1", handoff_id="r1#2", decode_worker_id="d0")

    def prefill_worker():
        worker = object.__new__(PrefillWorker)
        worker.worker_id, worker._deferred = "p0", {}
        draining = types.SimpleNamespace(job=first, status=PrefillStatus.TRANSFERRING)
        worker.scheduler = types.SimpleNamespace(jobs={"r1": draining})
        worker.replies = []
        worker.mailer = types.SimpleNamespace(send=lambda stream, msg: worker.replies.append(msg))
        return worker

    worker = prefill_worker()
    worker._accept(second)
    worker._accept(first)  # a true duplicate (the same job) is still ignored
    assert worker._deferred == {"r1": second}
    worker._accept_deferred()
    assert worker._deferred == {"r1": second}  # the first still drains
    del worker.scheduler.jobs["r1"]
    accepted = []
    worker._accept = accepted.append
    worker._accept_deferred()
    assert accepted == [second] and worker._deferred == {}

    worker = prefill_worker()
    worker._accept(second)
    worker._abort("r1")  # the client's abort of the later job: answered at once, under its handoff id
    assert [(m.status, m.handoff_id) for m in worker.replies] == [("aborted", "r1#2")] and worker._deferred == {}


def _live_peers(worker, monkeypatch, peers, ended):
    """The real refresh_peers over these registry records, ``ended`` the runs whose process is gone."""
    import tandem.decode.handoffs as handoffs_module

    del worker.handoffs.refresh_peers
    worker.handoffs.settings = types.SimpleNamespace(model_name="m", transfer_timeout_s=300.0, enable_prefix_caching=False)
    monkeypatch.setattr(handoffs_module, "live_workers", lambda client, role: peers)
    monkeypatch.setattr(handoffs_module, "ended_runs", lambda client, role, workers: set(ended))
    worker.handoffs._peers_checked_at = worker.handoffs._liveness_checked_at = 0.0


def test_a_prefill_worker_whose_process_is_gone_is_lost_before_its_record_expires(monkeypatch):
    """Its record still lives (the TTL), but its liveness subscription is gone and a beat is
    late: its job goes to the live worker at once, into fresh blocks (it may be only frozen, so
    the old ones are held), and it gets no new job."""
    worker = _worker()
    peers = [types.SimpleNamespace(worker_id="p0", started_at=1.0, device="cpu", model="m", draining=False),
             types.SimpleNamespace(worker_id="p1", started_at=1.0, device="cpu", model="m", draining=False)]
    _live_peers(worker, monkeypatch, peers, ended={("p0", 1.0)})
    request = _prefilling(worker, "r1", "p0", 1.0)
    old_blocks = list(request.block_ids)
    sent = []
    worker.handoffs._send_prefill_job = lambda r: (sent.append(r), setattr(r, "prefill_worker_id", "p1"))
    assert worker.handoffs.refresh_peers()
    assert [w.worker_id for w in worker.handoffs.prefill_workers] == ["p1"]
    assert [w.worker_id for w in worker.handoffs._taking_prefill_workers] == ["p1"]
    worker.handoffs.redispatch_lost()
    assert sent == [request] and not set(request.block_ids) & set(old_blocks)
    assert worker.handoffs.quarantine.num_blocks == len(old_blocks)
    assert [(stream, m.request_id) for stream, m in worker.redis.sent] == [("tandem:inbox:prefill:p0", "r1")]


def test_a_lost_prefill_workers_reply_sent_before_it_died_is_read_before_any_redispatch(monkeypatch):
    """Its PrefillDone (its first token already streamed) reached the inbox before its death was
    seen (whatever it sent, it sent before dying): the turn reads the inbox after looking for
    lost workers and before re-dispatching, so the request decodes on instead of being computed
    again."""
    import tandem.decode.handoffs as handoffs_module
    from tandem.kvtransfer import KVReceiver

    worker = _worker()
    worker._device_identity = "cpu"
    worker.handoffs.transport = types.SimpleNamespace(revoke_stops_writes=False, revoke=lambda handoff_id: None)
    del worker.handoffs.dispatch
    peers = [types.SimpleNamespace(worker_id="p0", started_at=1.0, device="cpu", model="m", draining=False),
             types.SimpleNamespace(worker_id="p1", started_at=1.0, device="cpu", model="m", draining=False)]
    _live_peers(worker, monkeypatch, peers, ended={("p0", 1.0)})
    request = _prefilling(worker, "r1", "p0", 1.0)
    request.receiver = KVReceiver(timeout_s=300.0)
    request.handoff_id = request.dispatch_id = "r1#1"
    worker.handoffs._send_prefill_job = lambda r: pytest.fail("re-dispatched a request whose prefill was done")
    replies = []

    def died(client, role, workers):  # p0 sent its reply, then died; now it is seen dead
        replies.append(PrefillDone("r1", "ok", 9, prefill_worker_id="p0", handoff_id="r1#1"))
        return {("p0", 1.0)}

    monkeypatch.setattr(handoffs_module, "ended_runs", died)
    worker.inbox.read = lambda block_ms=None: [replies.pop()] if replies else []
    worker.step()
    assert "r1" not in worker.scheduler.prefilling and request.output_token_ids == [9]
    assert worker.redis.sent == []  # no abort for p0: nothing of it was taken away


def test_a_lost_prefill_worker_whose_process_is_known_gone_leaves_the_blocks_to_the_redo(monkeypatch):
    """On this host, in this PID namespace, its pid tells: nothing can write the blocks any more,
    so the redo keeps them (no fresh blocks taken, nothing held)."""
    import subprocess
    import sys

    worker = _worker()
    peers = [types.SimpleNamespace(worker_id="p1", started_at=1.0, device="cpu", model="m", draining=False)]
    _live_peers(worker, monkeypatch, peers, ended=set())  # p0's record is gone too
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    request = _prefilling(worker, "r1", "p0", 1.0)
    request.prefill_pid = int(done.stdout)  # a process that has ended
    blocks, free = list(request.block_ids), worker.allocator.num_free
    sent = []
    worker.handoffs._send_prefill_job = sent.append
    worker.handoffs.refresh_peers()
    worker.handoffs.redispatch_lost()
    assert sent == [request] and request.block_ids == blocks
    assert worker.handoffs.quarantine.num_blocks == 0 and worker.allocator.num_free == free
