"""A decode worker lost under a request: the gateway resumes it on a live one
(another worker, or the same id restarted), bounded by the request's deadline;
with no worker that can take it the request ends with ``worker_lost``."""

from __future__ import annotations

import threading
import time

import httpx

from tests.gateway.conftest import parse_sse, post, token_script, wait_for


def test_worker_death_fails_the_request(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids, "length", delay_s=0.3), ttl_s=0.5)
    server = serve()
    threading.Timer(0.2, worker.die).start()
    started = time.time()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": len(text_ids)})
    assert time.time() - started < 5
    assert response.status_code == 503 and response.json()["error"]["code"] == "worker_lost"
    assert response.headers["retry-after"] == "1"


def test_worker_restarted_under_the_same_id_gets_the_request_again(serve, fake_worker, text_ids):
    def script(req):  # the first incarnation takes the request and "crashes" holding it
        return token_script(text_ids[:5], "length")(req) if req.request_id.endswith(".1") else []

    worker = fake_worker(script)

    def restart():
        worker.started_at = 1.0
        worker.beat()

    server = serve()
    threading.Timer(0.3, restart).start()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert response.status_code == 200, response.text
    first, again = worker.requests
    assert again.request_id == f"{first.request_id}.1" and again.output_token_ids == []
    assert response.json()["id"] not in (again.request_id,)  # the client keeps its own id


def test_stream_resumes_on_another_worker_when_its_worker_dies(serve, fake_worker, text_ids):
    def resuming(delay_s):
        def script(req):  # plays from the tokens the request already has, as a real worker does
            done = len(req.output_token_ids)
            return token_script(text_ids[:12], "length", delay_s=delay_s)(req)[done:]
        return script

    first = fake_worker(resuming(0.15), worker_id="decode-fake-0", ttl_s=0.5, num_free_blocks=64)
    server = serve()
    threading.Timer(0.8, first.die).start()
    time.sleep(0.05)
    second = fake_worker(resuming(0.0), worker_id="decode-fake-1", ttl_s=0.5, num_free_blocks=8)
    events = parse_sse(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 12, "stream": True,
                                                         "return_token_ids": True}).text)
    assert events[-1] == "[DONE]"
    token_ids = [t for e in events[:-1] for t in e["choices"][0].get("token_ids") or []]
    assert token_ids == text_ids[:12]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    (resumed,) = second.requests
    assert resumed.request_id == f"{first.requests[0].request_id}.1"
    assert 0 < len(resumed.output_token_ids) < 12 and resumed.output_token_ids == text_ids[:len(resumed.output_token_ids)]


def test_failover_waits_for_room_no_longer_than_the_request_deadline(serve, fake_worker, text_ids, redis_url):
    import redis as sync_redis

    from tandem.cluster import keys

    first = fake_worker(token_script(text_ids[:12], "length", delay_s=0.15), worker_id="decode-fake-0",
                        ttl_s=0.5, num_free_blocks=64)
    server = serve(request_timeout_s=2.0, queue_timeout_s=6.0)
    threading.Timer(0.5, first.die).start()
    time.sleep(0.05)
    client = sync_redis.Redis.from_url(redis_url)
    client.hset(keys.admitted("decode-fake-1"), "someone-else", 64 * 16)  # its whole pool is promised away
    client.set(keys.reserved_tokens("decode-fake-1"), 64 * 16)
    full = fake_worker(token_script(text_ids[:12], "length"), worker_id="decode-fake-1", ttl_s=0.5,
                       num_free_blocks=0)  # alive, but never has room
    started = time.time()
    events = parse_sse(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 12, "stream": True}).text)
    assert time.time() - started < 4, (time.time() - started, events[-2:])
    assert events[-1] == "[DONE]" and events[-2].get("error", {}).get("code") == "request_timeout", events[-2]
    assert full.requests == []


def test_resubmission_is_charged_as_the_new_worker_holds_it(serve, fake_worker, text_ids, redis_url):
    import redis as sync_redis

    from tandem.cluster import keys

    def resuming(delay_s):
        def script(req):
            return token_script(text_ids[:12], "length", delay_s=delay_s)(req)[len(req.output_token_ids):]
        return script

    first = fake_worker(resuming(0.15), worker_id="decode-fake-0", ttl_s=0.5, num_free_blocks=64)
    server = serve()
    threading.Timer(0.8, first.die).start()
    time.sleep(0.05)
    holds = [(30.0, None)]  # takes the request and holds its reservation (released when it would end)
    second = fake_worker(lambda req: holds, worker_id="decode-fake-1", ttl_s=0.5, num_free_blocks=8)
    client = sync_redis.Redis.from_url(redis_url)
    with httpx.Client(base_url=server.url, timeout=20) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 12, "stream": True}):
            assert wait_for(lambda: len(second.requests) == 1, timeout_s=10)
            (resumed,) = second.requests
            done = len(resumed.output_token_ids)
            charged = int(client.hget(keys.admitted("decode-fake-1"), resumed.request_id))
            # the worker's policy charge for prompt + tokens so far, then max_tokens - those
            assert charged >= len(resumed.prompt_token_ids) + done
            assert resumed.arrival_time == first.requests[0].arrival_time


def test_worker_death_mid_stream_ends_with_an_error_event(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids, "length", delay_s=0.2), ttl_s=0.5)
    server = serve()
    threading.Timer(0.5, worker.die).start()
    events = parse_sse(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 50, "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "worker_lost"
    assert events[-3]["choices"][0]["finish_reason"] == "error"


def _resuming(text_ids, n, delay_s):
    def script(req):  # plays from the tokens the request already has, as a real worker does
        return token_script(text_ids[:n], "length", delay_s=delay_s)(req)[len(req.output_token_ids):]
    return script


def test_a_lone_decode_worker_restarted_takes_its_requests_back(serve, fake_worker, text_ids):
    """One decode worker: it dies mid-stream and comes back as a new run under its id; the
    stream pauses, then continues on it (the failover waits for a live worker)."""
    worker = fake_worker(_resuming(text_ids, 12, 0.1), ttl_s=0.5)
    server = serve(failover_wait_s=10.0)

    def restart():
        worker._alive = False  # heartbeats stop; its key expires
        time.sleep(1.5)
        worker.started_at, worker._alive = 2.0, True  # the supervisor started it again
        worker.beat()

    threading.Timer(0.4, restart).start()
    events = parse_sse(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 12, "stream": True,
                                                         "return_token_ids": True}, timeout=30).text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
    assert [t for e in events[:-1] for t in e["choices"][0].get("token_ids") or []] == text_ids[:12]
    first, again = worker.requests[0], worker.requests[-1]
    assert again.request_id == f"{first.request_id}.1" and 0 < len(again.output_token_ids) < 12


def test_a_record_wiped_with_redis_does_not_fail_the_request_over(serve, fake_worker, text_ids, rclient):
    """Redis restarted without its data: the worker's record is gone before its TTL could run
    out. The worker goes on and re-registers; the request is not recomputed elsewhere."""
    from tandem.cluster import keys

    def paused(req):  # a second-long gap after token 3, while Redis is away: liveness is asked
        events = token_script(text_ids[:12], "length", delay_s=0.05)(req)
        events[4] = (1.5, events[4][1])
        return events

    worker = fake_worker(paused, ttl_s=0.5)
    server = serve(heartbeat_ttl_s=5.0, heartbeat_interval_s=1.0)

    def wipe():
        worker.beating = False
        rclient.delete(keys.worker("decode", worker.worker_id))
        time.sleep(0.8)  # longer than the gateway's liveness poll
        worker.beating = True
        worker.beat()

    threading.Timer(0.25, wipe).start()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 12, "return_token_ids": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == text_ids[:12]
    assert len(worker.requests) == 1  # never resubmitted
    assert "tandem_gateway_failovers_total 0.0" in httpx.get(server.url + "/metrics").text


def test_no_prefill_worker_is_503_with_retry_after_at_once(serve, fake_worker, text_ids):
    fake_worker(token_script(text_ids), with_prefill=False)
    server = serve()
    started = time.monotonic()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert time.monotonic() - started < 2
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == "no_worker_available" and "prefill" in error["message"]


def test_a_token_lost_in_transit_is_recomputed_elsewhere(serve, fake_worker, text_ids):
    """An event the gateway never reads (Redis lost it) leaves a gap later tokens wait behind:
    after GAP_TIMEOUT_S the request is failed over and its tokens recomputed."""
    def lossy(req):
        events = _resuming(text_ids, 12, 0.05)(req)
        return [e for e in events if e[1].index != 4] if not req.output_token_ids else events

    first = fake_worker(lossy, worker_id="decode-fake-0", num_free_blocks=64)
    server = serve()
    time.sleep(0.05)
    second = fake_worker(_resuming(text_ids, 12, 0.0), worker_id="decode-fake-1", num_free_blocks=8)
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 12, "return_token_ids": True})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == text_ids[:12]
    resumed = (first.requests + second.requests)[-1]
    assert resumed.output_token_ids == text_ids[:4]  # what the client had before the gap
