"""n > 1 through the gateway, against a real redis-server and a scripted decode worker: each
choice is its own request on the workers (``<id>-<i>``, seeded seed + i), the response holds
every choice by index, and a failing or abandoned request aborts all of its choices."""

from __future__ import annotations

import httpx

from tandem.cluster.messages import TokenEvent
from tests.gateway.conftest import TEXT, parse_sse, post, token_script, wait_for


def _by_choice(worker):
    return sorted(worker.requests, key=lambda r: r.request_id)


def test_n_choices_non_streaming(serve, fake_worker, tokenizer, text_ids):
    scripts = {0: text_ids + [2], 1: text_ids[:3], 2: text_ids[:1]}  # choice i's tokens
    worker = fake_worker(lambda req: token_script(scripts[int(req.request_id.rsplit("-", 1)[1])],
                                                  "stop" if req.request_id.endswith("-0") else "length")(req))
    server = serve()
    response = post(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 20, "n": 3, "seed": 7,
                                                "temperature": 0.8, "return_token_ids": True})
    assert response.status_code == 200, response.text
    body = response.json()
    requests = _by_choice(worker)
    assert [r.request_id for r in requests] == [f"{body['id']}-{i}" for i in range(3)]
    assert [r.sampling.seed for r in requests] == [7, 8, 9] and {r.sampling.temperature for r in requests} == {0.8}
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, TEXT, "stop"), (1, tokenizer.decode(text_ids[:3]), "length"), (2, tokenizer.decode(text_ids[:1]), "length")]
    assert [c["token_ids"] for c in body["choices"]] == [scripts[0], scripts[1], scripts[2]]
    num_prompt = len(requests[0].prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": len(text_ids) + 1 + 3 + 1,
                             "total_tokens": num_prompt + len(text_ids) + 5}
    assert worker.aborts == []  # every choice ended on the worker by itself
    mux = server.app.state.service.mux
    assert wait_for(lambda: mux.num_registered == 0)


def test_n_choices_stream_chat_by_index(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids, "length", delay_s=0.005))
    server = serve()
    response = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(text_ids), "n": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert {c["id"] for c in chunks} == {usage["id"]} and len(worker.requests) == 2
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == TEXT
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert usage["usage"]["completion_tokens"] == 2 * len(text_ids)
    assert {r.sampling.seed for r in worker.requests} == {None}  # unseeded choices stay unseeded


def test_a_failing_choice_fails_the_request_and_aborts_the_others(serve, fake_worker, text_ids):
    def script(req):
        if req.request_id.endswith("-1"):
            return [(0.2, TokenEvent(req.request_id, 0, [], "error", "no prefill worker alive"))]
        return token_script(text_ids * 20, "length", delay_s=0.05)(req)

    worker = fake_worker(script)
    server = serve()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 100, "n": 3})
    assert response.status_code == 503 and response.json()["error"]["code"] == "worker_error"
    assert wait_for(lambda: sorted(a.request_id for a in worker.aborts) ==
                    sorted(r.request_id for r in worker.requests if not r.request_id.endswith("-1")), timeout_s=5)
    assert wait_for(lambda: "tandem_gateway_requests_running 0.0" in httpx.get(server.url + "/metrics").text)


def test_a_client_leaving_a_stream_aborts_every_choice(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids * 20, "length", delay_s=0.05))
    server = serve()
    with httpx.Client(base_url=server.url, timeout=20) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 100,
                                                          "n": 2}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    assert wait_for(lambda: len(worker.aborts) == 2, timeout_s=5)
    assert sorted(a.request_id for a in worker.aborts) == sorted(r.request_id for r in worker.requests)
    assert {a.reason for a in worker.aborts} == {"client disconnected"}
