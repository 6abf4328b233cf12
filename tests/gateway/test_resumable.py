"""Resumable streams against a real redis-server and the fake decode worker: event ids on every
stream, a disconnect that does not abort, resumes by Last-Event-ID on the same or another gateway,
a takeover after the producing gateway is SIGKILLed, and the refusals (404, 400, n > 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tandem.cluster import keys
from tests.gateway.conftest import TEXT, free_port, post, token_script, wait_for


def parse_events(body: str) -> list[tuple[str, object]]:
    """(id, payload) of each SSE event; payload: a dict or "[DONE]"."""
    out = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(fields) == {"data", "id"}, block
        data = fields["data"]
        out.append((fields["id"], data if data == "[DONE]" else json.loads(data)))
    return out


def read_some(url: str, path: str, body: dict, num_events: int) -> tuple[str, list[tuple[str, object]]]:
    """Open a stream, read ``num_events`` events, then drop the connection: (request id, events)."""
    with httpx.Client(base_url=url, timeout=20) as http:
        with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200, response.read()
            request_id = response.headers["x-request-id"]
            text = ""
            for line in response.iter_lines():
                text += line + "\n"
                if text.count("\n\n") >= num_events:
                    break
    return request_id, parse_events(text)


def resume(url: str, request_id: str, last_event_id: str | None = None, query: bool = False) -> httpx.Response:
    path = f"{url}/v1/streams/{request_id}"
    if last_event_id is not None and query:
        return httpx.get(path, params={"last_event_id": last_event_id}, timeout=30)
    headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
    return httpx.get(path, headers=headers, timeout=30)


def check_one_stream(request_id: str, events: list[tuple[str, object]]) -> None:
    """Ids ``<request_id>.0`` ... in order, none repeated or missing, ending with [DONE]."""
    assert [i for i, _ in events] == [f"{request_id}.{seq}" for seq in range(len(events))]
    assert events[-1][1] == "[DONE]"


def text_of(events) -> str:
    return "".join(p["choices"][0].get("text", "") or p["choices"][0].get("delta", {}).get("content", "")
                   for _, p in events if isinstance(p, dict) and p.get("choices"))


def token_ids_of(events) -> list[int]:
    return [t for _, p in events if isinstance(p, dict) and p.get("choices") for t in p["choices"][0].get("token_ids", [])]


def resuming(token_ids: list[int], delay_s: float):
    """Plays from the tokens a (resubmitted) request already has, as a real decode worker does."""
    def script(req):
        return token_script(token_ids, "length", delay_s=delay_s)(req)[len(req.output_token_ids):]
    return script


def test_every_event_has_an_id_resumable_or_not(serve, fake_worker, text_ids):
    fake_worker(token_script(text_ids + [2], "stop"))
    server = serve()
    for path, body in [("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
                       ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"resumable": True}})]:
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        events = parse_events(response.text)
        check_one_stream(response.headers["x-request-id"], events)
        assert text_of(events) == TEXT


def test_a_resumable_stream_outlives_its_client_and_resumes_from_last_event_id(serve, fake_worker, rclient, text_ids):
    tokens = text_ids * 3
    worker = fake_worker(token_script(tokens, "length", delay_s=0.03))
    server = serve()
    body = {"prompt": "hi", "max_tokens": len(tokens), "stream": True, "return_token_ids": True,
            "stream_options": {"resumable": True, "include_usage": True}}
    request_id, first = read_some(server.url, "/v1/completions", body, num_events=4)
    assert len(first) == 4 and first[0][0] == f"{request_id}.0"
    # the request runs on without its client, to its end
    assert wait_for(lambda: rclient.hget(keys.sse_request(request_id), "next") == str(len(tokens) + 2).encode(),
                    timeout_s=10), rclient.hgetall(keys.sse_request(request_id))
    assert worker.aborts == []
    rest = parse_events(resume(server.url, request_id, first[-1][0]).text)
    events = first + rest
    check_one_stream(request_id, events)
    assert token_ids_of(events) == tokens and text_of(events) == TEXT * 3
    assert events[-2][1]["usage"]["completion_tokens"] == len(tokens)
    assert worker.aborts == [] and [r.request_id for r in worker.requests] == [request_id]
    # the whole stream again from the start (no Last-Event-ID), and from the query parameter
    assert parse_events(resume(server.url, request_id).text) == events
    assert parse_events(resume(server.url, request_id, events[5][0], query=True).text) == events[6:]
    # the last event's id: nothing remains, 204 tells an EventSource to stop reconnecting
    assert resume(server.url, request_id, events[-1][0]).status_code == 204
    mux = server.app.state.service.mux
    assert wait_for(lambda: mux.num_registered == 0)
    assert rclient.get(keys.sse_lease(request_id)) is None, "the finished stream's lease is let go"
    assert 0 < rclient.pttl(keys.sse_log(request_id)) <= 300_000


def test_resume_on_another_gateway_follows_the_stream_live(serve, fake_worker, text_ids):
    tokens = text_ids * 2
    worker = fake_worker(token_script(tokens, "length", delay_s=0.05))
    first_gateway, second_gateway = serve(), serve()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(tokens), "stream": True,
            "stream_options": {"resumable": True}}
    request_id, first = read_some(first_gateway.url, "/v1/chat/completions", body, num_events=3)
    assert first[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    rest = parse_events(resume(second_gateway.url, request_id, first[-1][0]).text)  # live: the request still runs
    events = first + rest
    check_one_stream(request_id, events)
    assert text_of(events) == TEXT * 2
    assert events[-2][1]["choices"][0]["finish_reason"] == "length"
    assert worker.aborts == [] and len(worker.requests) == 1


def test_a_stream_whose_gateway_was_killed_is_taken_over_by_the_resuming_gateway(
        serve, fake_worker, rclient, redis_url, model_dir, text_ids):
    tokens = text_ids * 2
    worker = fake_worker(resuming(tokens, 0.1))
    port = free_port()
    lost = subprocess.Popen([sys.executable, "-m", "tandem", "gateway", "--model", model_dir, "--served-model-name",
                             "tiny", "--redis-url", redis_url, "--port", str(port), "--admin-port", "0"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _answers(url), timeout_s=60), "the gateway process did not start"
        body = {"prompt": "hi", "max_tokens": len(tokens), "stream": True, "return_token_ids": True,
                "stream_options": {"resumable": True}}
        request_id, first = read_some(url, "/v1/completions", body, num_events=4)
        lost.send_signal(signal.SIGKILL)
        lost.wait(10)
    finally:
        if lost.poll() is None:
            lost.kill()
    resumer = serve()
    started = time.monotonic()
    rest = parse_events(resume(resumer.url, request_id, first[-1][0]).text)
    events = first + rest
    check_one_stream(request_id, events)
    assert token_ids_of(events) == tokens and text_of(events) == TEXT * 2
    assert time.monotonic() - started < 15
    original, resubmitted = worker.requests
    assert original.request_id == request_id and resubmitted.request_id == f"{request_id}.4"
    assert 0 < len(resubmitted.output_token_ids) < len(tokens)
    assert resubmitted.output_token_ids == tokens[:len(resubmitted.output_token_ids)]
    assert resubmitted.arrival_time == original.arrival_time
    assert resubmitted.reply_to == keys.gateway_output(resumer.app.state.service.mux.gateway_id)
    # the worker that was writing to the lost gateway is told to stop
    assert wait_for(lambda: [(a.request_id, a.reason) for a in worker.aborts] == [(request_id, "gateway lost")])
    assert wait_for(lambda: rclient.hlen(keys.admitted(worker.worker_id)) == 0)


def test_unknown_expired_and_malformed_ids(serve, fake_worker, text_ids):
    fake_worker(token_script(text_ids[:3], "length"))
    server = serve(stream_retention_s=2.0)
    unknown = resume(server.url, "cmpl-nosuchstream")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "stream_not_found"
    assert set(unknown.json()["error"]) == {"message", "type", "param", "code"}
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True,
                                                "stream_options": {"resumable": True}})
    request_id = response.headers["x-request-id"]
    events = parse_events(response.text)
    assert parse_events(resume(server.url, request_id, events[0][0]).text) == events[1:]
    for bad in ["garbage", f"{request_id}", f"{request_id}.x", f"{request_id}.-1", f"cmpl-other.1",
                f"{request_id}.{len(events)}"]:
        answer = resume(server.url, request_id, bad)
        assert answer.status_code == 400, (bad, answer.text)
        assert answer.json()["error"]["param"] == "last_event_id"
    time.sleep(2.5)  # past its retention
    assert resume(server.url, request_id, events[0][0]).status_code == 404


def test_a_resumable_stream_has_one_choice(serve, fake_worker):
    worker = fake_worker(token_script([5], "length"))
    server = serve()
    response = post(server, "/v1/completions", {"prompt": "hi", "n": 2, "stream": True,
                                                "stream_options": {"resumable": True}})
    assert response.status_code == 400
    assert "resumable needs n = 1" in response.json()["error"]["message"]
    assert worker.requests == []
    assert post(server, "/v1/completions", {"prompt": "hi", "n": 2, "stream": True}).status_code == 200


def test_a_stream_that_is_not_resumable_is_still_aborted_by_a_disconnect(serve, fake_worker, rclient, text_ids):
    worker = fake_worker(token_script(text_ids * 20, "length", delay_s=0.05))
    server = serve()
    request_id, first = read_some(server.url, "/v1/completions",
                                  {"prompt": "hi", "max_tokens": 100, "stream": True}, num_events=2)
    assert [i for i, _ in first] == [f"{request_id}.0", f"{request_id}.1"]
    assert wait_for(lambda: [a.reason for a in worker.aborts] == ["client disconnected"])
    assert rclient.exists(keys.sse_request(request_id)) == 0, "nothing retained"
    assert resume(server.url, request_id).status_code == 404


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
