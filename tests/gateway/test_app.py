"""The gateway against a real redis-server and a fake decode worker that writes TokenEvents.

This tests the gateway alone: the worker is scripted (see conftest.FakeDecodeWorker).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from tandem.cluster.messages import TokenEvent
from tests.gateway.conftest import MAX_POSITIONS, TEXT, parse_sse, post, register_prefill, token_script, wait_for


def stream_text(events):
    return "".join(e["choices"][0].get("text", "") for e in events if isinstance(e, dict) and e.get("choices"))


def test_completion_non_streaming(serve, fake_worker, rclient, text_ids):
    worker = fake_worker(token_script(text_ids + [2], "stop", cached=2))
    server = serve()
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 50,
                                                "temperature": 0, "seed": 7, "top_k": -1, "priority": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop"}]
    num_prompt = len(worker.requests[0].prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": len(text_ids) + 1,
                             "total_tokens": num_prompt + len(text_ids) + 1,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    req = worker.requests[0]
    assert req.request_id == body["id"] and req.max_tokens == 50 and req.priority == 3
    assert (req.sampling.temperature, req.sampling.top_k, req.sampling.seed) == (0.0, 0, 7)
    assert req.reply_to.startswith("tandem:out:gw:"), "tokens come back on the gateway's own stream"
    mux = server.app.state.service.mux
    assert wait_for(lambda: mux.num_registered == 0), "a finished request leaves no queue behind"


def test_completion_streaming_with_usage_and_token_ids(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids, "length", delay_s=0.005))
    server = serve()
    response = post(server, "/v1/completions", {
        "prompt": [5, 6, 7], "max_tokens": len(text_ids), "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert stream_text(chunks) == TEXT
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == text_ids
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(text_ids)
    assert usage["usage"]["prompt_tokens"] == 3
    assert worker.requests[0].prompt_token_ids == [5, 6, 7]  # token-id prompts get no BOS


def test_default_max_tokens_as_openai(serve, fake_worker):
    """Completions: 16 tokens unless told (OpenAI, vLLM); chat and an explicit null: up to the end
    of the context; max_completion_tokens wins over max_tokens."""
    worker = fake_worker(token_script([5], "length"))
    server = serve()
    chat = [{"role": "user", "content": "hi"}]
    for route, body in [("/v1/completions", {"prompt": [5] * 10}),
                        ("/v1/completions", {"prompt": [5] * 10, "max_tokens": None}),
                        ("/v1/chat/completions", {"messages": chat}),
                        ("/v1/chat/completions", {"messages": chat, "max_tokens": 7, "max_completion_tokens": 5})]:
        assert post(server, route, body).status_code == 200, (route, body)
    chat_prompt = len(worker.requests[2].prompt_token_ids)
    assert [r.max_tokens for r in worker.requests] == [16, MAX_POSITIONS - 10, MAX_POSITIONS - chat_prompt, 5]


def test_text_parts_are_joined_by_newlines_and_a_batch_of_one_prompt_is_one_prompt(serve, fake_worker, tokenizer):
    worker = fake_worker(token_script([5], "length"))
    server = serve()
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]}).status_code == 200
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hello\nworld"}],
                                             add_generation_prompt=True, tokenize=False)
    assert worker.requests[0].prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert post(server, "/v1/completions", {"prompt": [[5, 6, 7]], "max_tokens": 1}).status_code == 200
    assert worker.requests[1].prompt_token_ids == [5, 6, 7]


def test_chat_template_controls_render_as_transformers_does(serve, fake_worker, tokenizer):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs reach the
    template as they reach transformers' apply_chat_template."""
    worker = fake_worker(token_script([5], "length"))
    server = serve()
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hel"}]
    forms = [{"add_generation_prompt": False},
             {"add_generation_prompt": False, "continue_final_message": True},
             {"chat_template_kwargs": {"custom_flag": True}}]
    for form in forms:
        assert post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **form}).status_code == 200
    template = {"add_generation_prompt": True, "continue_final_message": False}
    for request, form in zip(worker.requests, forms):
        kwargs = {**template, **{k: v for k, v in form.items() if k != "chat_template_kwargs"},
                  **form.get("chat_template_kwargs", {})}
        expected = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        assert request.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    opened = tokenizer.decode(worker.requests[1].prompt_token_ids)
    assert opened.endswith("Hel") and not tokenizer.decode(worker.requests[0].prompt_token_ids).endswith("Hel")


def test_chat_non_streaming_and_streaming(serve, fake_worker, tokenizer, text_ids):
    worker = fake_worker(token_script(text_ids + [2], "stop"))
    server = serve()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    body = post(server, "/v1/chat/completions", {"model": "tiny", "messages": messages}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TEXT}
    assert body["choices"][0]["finish_reason"] == "stop"
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert worker.requests[0].prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)

    events = parse_sse(post(server, "/v1/chat/completions", {"messages": messages, "stream": True}).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_cuts_the_text_and_aborts_the_worker(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids + text_ids, "length", delay_s=0.01))
    server = serve()
    for stream in (False, True):
        response = post(server, "/v1/completions", {"prompt": "hi", "stop": ["are", "zzz"], "max_tokens": 100,
                                                    "stream": stream})
        if stream:
            events = parse_sse(response.text)
            text, finish = stream_text(events[:-1]), events[-2]["choices"][0]["finish_reason"]
        else:
            text, finish = response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]
        assert (text, finish) == ("Hello world! How ", "stop")
    assert wait_for(lambda: len(worker.aborts) == 2)
    assert {a.request_id for a in worker.aborts} == {r.request_id for r in worker.requests}
    assert all(a.reason == "stop string" for a in worker.aborts)


def test_stop_token_text_is_not_output(serve, fake_worker, tokenizer, text_ids):
    full = tokenizer.encode(TEXT + " Paris", add_special_tokens=False)
    stop_id = full[-1]
    fake_worker(token_script(full, "stop"))
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "hi", "stop_token_ids": [stop_id]}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == tokenizer.decode(full[:-1])
    assert body["usage"]["completion_tokens"] == len(full)


def test_events_out_of_order_and_repeated(serve, fake_worker, text_ids):
    a, b, c, d = text_ids[:4]

    def script(req):
        rid = req.request_id
        return [(0, TokenEvent(rid, 1, [b])), (0, TokenEvent(rid, 0, [a])), (0, TokenEvent(rid, 0, [a])),
                (0, TokenEvent(rid, 1, [b, c])), (0, TokenEvent(rid, 3, [d], "length"))]

    fake_worker(script)
    server = serve()
    body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "return_token_ids": True}).json()
    assert body["choices"][0]["token_ids"] == [a, b, c, d]


def test_streaming_client_disconnect_aborts(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids * 20, "length", delay_s=0.05))
    server = serve()
    with httpx.Client(base_url=server.url, timeout=20) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 100}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    assert wait_for(lambda: len(worker.aborts) == 1, timeout_s=5)
    assert worker.aborts[0].request_id == worker.requests[0].request_id
    assert worker.aborts[0].reason == "client disconnected"
    assert wait_for(lambda: "tandem_gateway_requests_running 0.0" in httpx.get(server.url + "/metrics").text)


def test_disconnect_before_the_first_token_aborts(serve, fake_worker):
    worker = fake_worker(lambda req: [])  # queued forever
    server = serve()
    with httpx.Client(base_url=server.url, timeout=20) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 5}):
            assert wait_for(lambda: len(worker.requests) == 1)
    assert wait_for(lambda: [a.reason for a in worker.aborts] == ["client disconnected"], timeout_s=5)


def test_non_streaming_client_disconnect_aborts(serve, fake_worker, text_ids):
    worker = fake_worker(token_script(text_ids * 20, "length", delay_s=0.05))
    server = serve()
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 100}, timeout=0.5)
    assert wait_for(lambda: len(worker.aborts) == 1, timeout_s=5)
    assert worker.aborts[0].request_id == worker.requests[0].request_id
    assert worker.requests[0].reply_to.startswith("tandem:out:gw:")


def test_worker_error_event(serve, fake_worker):
    fake_worker(lambda req: [(0, TokenEvent(req.request_id, 0, [], "error", "no prefill worker alive"))])
    server = serve()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "worker_error"
    assert "no prefill worker alive" in response.json()["error"]["message"]


def test_request_timeout_aborts_and_504(serve, fake_worker):
    worker = fake_worker(lambda req: [])  # accepts and never answers
    server = serve(request_timeout_s=0.6)
    started = time.time()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 5})
    assert 0.5 < time.time() - started < 3
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
    assert wait_for(lambda: [a.reason for a in worker.aborts] == ["timeout"])


def test_routing_prefers_room(serve, fake_worker):
    big = fake_worker(token_script([5], "length"), worker_id="decode-big", num_free_blocks=40)
    small = fake_worker(token_script([5], "length"), worker_id="decode-small", num_free_blocks=30)
    server = serve()
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert len(big.requests) == 1 and not small.requests


def test_two_gateways_never_oversubscribe_a_worker(redis_url, rclient, fake_worker):
    import redis.asyncio as aioredis

    from tandem.cluster import keys
    from tandem.gateway.router import Router

    fake_worker(lambda req: [], worker_id="decode-a", num_total_blocks=12)  # 192 tokens
    fake_worker(lambda req: [], worker_id="decode-b", num_total_blocks=10)  # 160 tokens

    async def burst():
        clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
        routers = [Router(client, cache_ttl_s=60.0) for client in clients]  # two gateways, one snapshot each
        # 40 requests of 16 + 16 tokens (2 blocks) from both gateways at once
        workers = await asyncio.gather(*(routers[i % 2].reserve(f"r{i}", 16, 16) for i in range(40)))
        chosen = [w.worker_id if w else None for w in workers]
        await routers[0].release(chosen[0], "r0")
        await routers[1].release(chosen[0], "r0")  # a second release is a no-op
        late = await routers[1].reserve("late", 16, 16)  # the room r0 gave back
        for client in clients:
            await client.aclose()
        return chosen, late.worker_id

    chosen, late = asyncio.run(burst())
    assert (chosen.count("decode-a"), chosen.count("decode-b"), chosen.count(None)) == (6, 5, 29)
    assert late == chosen[0]
    assert int(rclient.get(keys.reserved_tokens("decode-a"))) == 192
    assert int(rclient.get(keys.reserved_tokens("decode-b"))) == 160
    assert rclient.hlen(keys.admitted("decode-a")) == 6 and rclient.hlen(keys.admitted("decode-b")) == 5

def test_models_health_metrics(serve, fake_worker, rclient):
    fake_worker(token_script([5], "length"), with_prefill=False)
    server = serve()
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 503  # no prefill worker yet
    register_prefill(rclient)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["decode_workers"] == 1
    post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    text = httpx.get(server.url + "/metrics").text
    assert 'tandem_gateway_requests_total{route="/v1/completions",status="200"} 1.0' in text
    assert 'tandem_gateway_requests_total{route="/v1/completions",status="400"} 1.0' in text
    assert "tandem_gateway_generation_tokens_total 1.0" in text
    assert "tandem_gateway_time_to_first_token_seconds_count 1.0" in text
    assert 'tandem_worker_num_free_blocks{role="decode",worker="decode-fake-0"} 64.0' in text
    assert 'tandem_worker_num_free_blocks{role="prefill",worker="prefill-fake-0"}' in text


def test_openai_client(serve, fake_worker, text_ids):
    openai = pytest.importorskip("openai")
    fake_worker(token_script(text_ids + [2], "stop"))
    server = serve()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=50)
    assert completion.choices[0].text == TEXT
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    assert chunks[-1].usage.completion_tokens == len(text_ids) + 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)


def test_many_concurrent_streams(serve, fake_worker, text_ids):
    fake_worker(token_script(text_ids, "length", delay_s=0.002))
    server = serve()

    def one(i):
        body = {"prompt": f"request {i}", "max_tokens": len(text_ids), "stream": True}
        return stream_text(parse_sse(post(server, "/v1/completions", body, timeout=60).text)[:-1])

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(64))) == [TEXT] * 64


def test_gateway_imports_no_torch(model_dir):
    code = (
        "import sys; import tandem.gateway.app, tandem.gateway.server; from tandem.cluster.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({model_dir!r}); t.apply_chat_template([{{'role': 'user', 'content': 'x'}}], "
        "add_generation_prompt=True, tokenize=False); "
        "bad = [m for m in ('torch', 'tandem.engine', 'tandem.kernels') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_redis_restart_gives_503_then_recovers(model_dir, tmp_path):
    from tandem.gateway.app import create_app
    from tests.gateway.conftest import FakeDecodeWorker, ServerThread, free_port, make_settings
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    url = f"redis://127.0.0.1:{port}/0"

    def start_redis():
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis as sync_redis

        assert wait_for(lambda: _pings(sync_redis.Redis.from_url(url)))
        return proc

    proc = start_redis()
    worker = FakeDecodeWorker(url, token_script([5, 6], "length")).start()
    try:
        with ServerThread(create_app(make_settings(model_dir, url))) as server:
            body = {"prompt": "hi", "max_tokens": 2}
            assert post(server, "/v1/completions", body).status_code == 200
            proc.terminate()
            proc.wait()
            time.sleep(0.3)  # let the registry cache expire
            down = post(server, "/v1/completions", body)
            assert down.status_code == 503 and down.headers["retry-after"] == "1"
            assert httpx.get(server.url + "/health").status_code == 503
            proc = start_redis()
            assert wait_for(lambda: post(server, "/v1/completions", body).status_code == 200, timeout_s=10)
    finally:
        worker._stop.set()
        proc.terminate()
        proc.wait()


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False
