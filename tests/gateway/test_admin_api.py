"""The gRPC admin API against a real gateway and Redis, with fake decode workers: workers and
their drain state, live policies, draining steering new requests away, cancelling a request;
bad arguments get a clear status and change nothing."""

from __future__ import annotations

import threading

import grpc
import pytest

from tandem.cluster import keys
from tandem.cluster.draining import SETTLE_S, read_marks
from tandem.gateway.admin import CANCEL_REASON, pb, pb_grpc
from tests.gateway.conftest import parse_sse, post, register_prefill, token_script, wait_for


@pytest.fixture
def admin(admin_channel):
    """admin(**settings) -> (gateway server, AdminStub on its admin port)."""
    def start(**overrides):
        server, channel = admin_channel(**overrides)
        return server, pb_grpc.AdminStub(channel)

    return start


def _status(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_list_workers_of_both_pools_and_of_one(admin, fake_worker, rclient, text_ids):
    fake_worker(token_script(text_ids), worker_id="decode-a", num_free_blocks=60, with_prefill=False)
    register_prefill(rclient, "prefill-a")
    _server, stub = admin()
    workers = stub.ListWorkers(pb.ListWorkersRequest()).workers
    assert [(w.role, w.worker_id) for w in workers] == [("decode", "decode-a"), ("prefill", "prefill-a")]
    decode = workers[0]
    assert (decode.num_free_blocks, decode.num_total_blocks, decode.draining, decode.drained) == (60, 64, False, False)
    assert [w.worker_id for w in stub.ListWorkers(pb.ListWorkersRequest(role="prefill")).workers] == ["prefill-a"]
    assert _status(lambda: stub.ListWorkers(pb.ListWorkersRequest(role="router"))) == grpc.StatusCode.INVALID_ARGUMENT


def test_policies_are_read_and_switched_for_the_cluster(admin, rclient):
    _server, stub = admin()
    rclient.hset(keys.policy(), mapping={"capacity_scheduler_policy": "GUARANTEED_NO_EVICT",
                                         "context_chunking_policy": "FIRST_COME_FIRST_SERVED"})
    policies = stub.GetPolicies(pb.GetPoliciesRequest())
    assert (policies.capacity_scheduler_policy, policies.context_chunking_policy) == (
        pb.GUARANTEED_NO_EVICT, pb.FIRST_COME_FIRST_SERVED)
    policies = stub.SetPolicies(pb.SetPoliciesRequest(capacity_scheduler_policy=pb.MAX_UTILIZATION))
    assert (policies.capacity_scheduler_policy, policies.context_chunking_policy) == (
        pb.MAX_UTILIZATION, pb.FIRST_COME_FIRST_SERVED)  # the field left unspecified is kept
    assert rclient.hget(keys.policy(), "capacity_scheduler_policy") == b"MAX_UTILIZATION"  # what workers re-read
    stub.SetPolicies(pb.SetPoliciesRequest(context_chunking_policy=pb.EQUAL_PROGRESS))
    assert rclient.hget(keys.policy(), "context_chunking_policy") == b"EQUAL_PROGRESS"


def test_bad_policy_requests_change_nothing(admin, rclient):
    _server, stub = admin()
    rclient.hset(keys.policy(), "capacity_scheduler_policy", "STATIC_BATCH")
    assert _status(lambda: stub.SetPolicies(pb.SetPoliciesRequest())) == grpc.StatusCode.INVALID_ARGUMENT
    bad = pb.SetPoliciesRequest(capacity_scheduler_policy=pb.GUARANTEED_NO_EVICT, context_chunking_policy=7)
    assert _status(lambda: stub.SetPolicies(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    assert rclient.hgetall(keys.policy()) == {b"capacity_scheduler_policy": b"STATIC_BATCH"}
    rclient.hset(keys.policy(), "context_chunking_policy", "SHORTEST_FIRST")  # set by hand; workers ignore it
    assert stub.GetPolicies(pb.GetPoliciesRequest()).context_chunking_policy == pb.CONTEXT_CHUNKING_POLICY_UNSPECIFIED


def test_a_drained_decode_worker_gets_no_new_requests_and_undrain_gives_them_back(admin, fake_worker, text_ids):
    busy = fake_worker(token_script(text_ids[:3]), worker_id="decode-a", num_free_blocks=64)
    other = fake_worker(token_script(text_ids[:3]), worker_id="decode-b", num_free_blocks=8)
    server, stub = admin()
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200
    assert len(busy.requests) == 1  # the most room wins
    worker = stub.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-a"))
    assert (worker.role, worker.draining, worker.drained) == ("decode", True, False)  # routers see it soon
    listed = {w.worker_id: w.draining for w in stub.ListWorkers(pb.ListWorkersRequest(role="decode")).workers}
    assert listed == {"decode-a": True, "decode-b": False}
    threading.Event().wait(0.3)  # the router's registry snapshot is at most 0.25 s old
    for _ in range(3):
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200
    assert (len(busy.requests), len(other.requests)) == (1, 3)
    stub.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-b"))
    threading.Event().wait(0.3)
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert response.status_code == 503 and "drained" in response.json()["error"]["message"]
    assert not stub.UndrainWorker(pb.UndrainWorkerRequest(worker_id="decode-a")).draining
    threading.Event().wait(0.3)
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200
    assert len(busy.requests) == 2


def test_drained_only_once_every_router_saw_the_drain_and_nothing_is_held(admin, fake_worker, rclient, text_ids):
    fake_worker(token_script(text_ids[:3]), worker_id="decode-a", ttl_s=0.4)  # beats every 0.1 s
    fake_worker(token_script(text_ids[:3]), worker_id="decode-b", ttl_s=0.4)
    _server, stub = admin()

    def listed():
        return {w.worker_id: w for w in stub.ListWorkers(pb.ListWorkersRequest(role="decode")).workers}

    def drained():
        return {worker_id: w.drained for worker_id, w in listed().items()}

    rclient.hset(keys.admitted("decode-b"), "cmpl-on-its-way", 16)  # admitted, not yet in its inbox
    for worker_id in ("decode-a", "decode-b"):
        assert not stub.DrainWorker(pb.DrainWorkerRequest(worker_id=worker_id)).drained
    assert drained() == {"decode-a": False, "decode-b": False}  # a gateway may still hold an old snapshot
    assert wait_for(lambda: drained()["decode-a"], timeout_s=5)
    settled_at = read_marks(rclient, "decode")["decode-b"].marked_at + SETTLE_S
    assert wait_for(lambda: listed()["decode-b"].heartbeat_at >= settled_at, timeout_s=5)
    assert not drained()["decode-b"]  # every router saw its drain, but a request is on its way to it
    rclient.hdel(keys.admitted("decode-b"), "cmpl-on-its-way")
    assert drained()["decode-b"]


def test_a_drain_names_one_incarnation(admin, fake_worker, rclient, text_ids):
    """A worker restarted under its id (compose and `tandem serve` use fixed ids) takes work again."""
    worker = fake_worker(token_script(text_ids[:3]), worker_id="decode-a", started_at=1.0)
    _server, stub = admin()
    stub.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-a", role="decode"))
    worker.started_at = 2.0
    worker.beat()
    (listed,) = stub.ListWorkers(pb.ListWorkersRequest(role="decode")).workers
    assert not listed.draining


def test_a_lapsed_heartbeat_keeps_its_drain(admin, fake_worker, text_ids):
    """A worker whose key expired for a moment (a Redis blip, a stalled heartbeat) is the same run
    when it is back: draining another worker meanwhile must not forget its drain."""
    a = fake_worker(token_script(text_ids[:3]), worker_id="decode-a", ttl_s=0.3)
    fake_worker(token_script(text_ids[:3]), worker_id="decode-b")
    _server, stub = admin()
    stub.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-a"))
    a.die()
    assert wait_for(lambda: len(stub.ListWorkers(pb.ListWorkersRequest(role="decode")).workers) == 1)
    stub.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-b"))
    a._alive = True
    a.beat()
    listed = {w.worker_id: w.draining for w in stub.ListWorkers(pb.ListWorkersRequest(role="decode")).workers}
    assert listed == {"decode-a": True, "decode-b": True}


def test_a_stream_whose_worker_dies_resumes_on_a_draining_worker_rather_than_fail(admin, fake_worker, text_ids):
    def resuming(delay_s):
        def script(req):  # plays from the tokens the request already has, as a real worker does
            return token_script(text_ids[:12], "length", delay_s=delay_s)(req)[len(req.output_token_ids):]
        return script

    first = fake_worker(resuming(0.15), worker_id="decode-a", ttl_s=0.5, num_free_blocks=64)
    second = fake_worker(resuming(0.0), worker_id="decode-b", ttl_s=0.5, num_free_blocks=8)
    server, stub = admin()
    stub.DrainWorker(pb.DrainWorkerRequest(worker_id="decode-b"))  # maintenance on b, then a dies
    threading.Event().wait(0.3)
    threading.Timer(0.8, first.die).start()
    events = parse_sse(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 12, "stream": True,
                                                         "return_token_ids": True}).text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert [t for e in events[:-1] for t in e["choices"][0].get("token_ids") or []] == text_ids[:12]
    (resumed,) = second.requests
    assert resumed.request_id == f"{first.requests[0].request_id}.1"
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 503  # new ones: no


def test_drain_errors(admin, fake_worker, rclient, text_ids):
    fake_worker(token_script(text_ids[:3]), worker_id="twin")
    register_prefill(rclient, "twin")
    _server, stub = admin()
    assert _status(lambda: stub.DrainWorker(pb.DrainWorkerRequest(worker_id="nobody"))) == grpc.StatusCode.NOT_FOUND
    assert _status(lambda: stub.DrainWorker(pb.DrainWorkerRequest(worker_id=""))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _status(lambda: stub.DrainWorker(pb.DrainWorkerRequest(worker_id="twin"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _status(lambda: stub.UndrainWorker(pb.UndrainWorkerRequest(worker_id="twin", role="x"))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert not rclient.exists(keys.draining("decode")) and not rclient.exists(keys.draining("prefill"))
    assert stub.DrainWorker(pb.DrainWorkerRequest(worker_id="twin", role="prefill")).role == "prefill"


def test_cancel_sends_the_worker_an_abort_for_the_request(admin, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids[:40], delay_s=0.1))
    server, stub = admin(request_timeout_s=3.0)  # the fake worker ends no stream on an abort (a real one does)
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        response=post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 40})))
    thread.start()
    assert wait_for(lambda: len(worker.requests) == 1)
    request_id = worker.requests[0].request_id
    assert _status(lambda: stub.CancelRequest(pb.CancelRequestRequest(request_id="cmpl-*"))) == \
        grpc.StatusCode.NOT_FOUND  # a pattern is a literal id, not a wildcard
    assert _status(lambda: stub.CancelRequest(pb.CancelRequestRequest(request_id=request_id[:-1]))) == \
        grpc.StatusCode.NOT_FOUND  # a prefix of an id is not that id
    assert _status(lambda: stub.CancelRequest(pb.CancelRequestRequest())) == grpc.StatusCode.INVALID_ARGUMENT
    assert worker.aborts == []
    assert stub.CancelRequest(pb.CancelRequestRequest(request_id=request_id)).worker_id == worker.worker_id
    assert wait_for(lambda: len(worker.aborts) == 1)
    assert (worker.aborts[0].request_id, worker.aborts[0].reason) == (request_id, CANCEL_REASON)
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_redis_unavailable_is_a_clear_status(admin, rclient, redis_server):
    import redis as redis_lib

    _server, stub = admin()
    stub.GetPolicies(pb.GetPoliciesRequest())
    rclient.config_set("requirepass", "locked")  # the gateway's connections are cut and cannot log in again
    rclient.client_kill_filter(_type="normal", skipme=True)
    try:
        status = _status(lambda: stub.GetPolicies(pb.GetPoliciesRequest(), timeout=10))
    finally:
        redis_lib.Redis.from_url(redis_server, password="locked").config_set("requirepass", "")
    assert status == grpc.StatusCode.UNAVAILABLE


def test_cancel_of_a_request_with_n_choices_ends_every_choice(admin, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids[:40], delay_s=0.1))
    server, stub = admin(request_timeout_s=3.0)
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        response=post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 40, "n": 3})))
    thread.start()
    assert wait_for(lambda: len(worker.requests) == 3)
    choice_ids = sorted(r.request_id for r in worker.requests)
    base = choice_ids[0].rsplit("-", 1)[0]
    one = stub.CancelRequest(pb.CancelRequestRequest(request_id=choice_ids[1]))  # one choice alone
    assert list(one.request_ids) == [choice_ids[1]]
    assert wait_for(lambda: [a.request_id for a in worker.aborts] == [choice_ids[1]])  # its room given back
    response = stub.CancelRequest(pb.CancelRequestRequest(request_id=base))  # the request: every choice left
    assert list(response.request_ids) == [choice_ids[0], choice_ids[2]] and response.worker_id == worker.worker_id
    assert wait_for(lambda: sorted(a.request_id for a in worker.aborts) == choice_ids)
    thread.join(timeout=30)
    assert not thread.is_alive()
