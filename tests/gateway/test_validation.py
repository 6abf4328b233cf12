"""Every rejected request gets the OpenAI error shape and the right status; none reaches a worker."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from tandem.gateway.app import MAX_BODY_BYTES, create_app
from tests.gateway.conftest import MAX_POSITIONS, free_port, make_settings, register_prefill, token_script

LONG = [5] * MAX_POSITIONS  # max_input_len = MAX_POSITIONS - 1


@pytest.fixture(scope="module")
def client(model_dir):
    # nothing listens on this port: a request that got past validation would fail with 503, not 400
    app = create_app(make_settings(model_dir, f"redis://127.0.0.1:{free_port()}/0"))
    with TestClient(app, raise_server_exceptions=False) as client:  # one event loop for all requests
        yield client


def assert_openai_error(response, status, param=None, code=None, kind="invalid_request_error"):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == kind
    if param is not None:
        assert error["param"] == param
    assert error["code"] == code
    return error


COMPLETION_CASES = {
    "prompt missing": ({"model": "tiny"}, "prompt"),
    "prompt wrong type": ({"prompt": 123}, "prompt"),
    "a batch with a token id out of the vocabulary": ({"prompt": [[1, 2], [100000]]}, "prompt"),
    "prompt list of lists of strings": ({"prompt": [["a"]]}, "prompt"),
    "stream_options without stream": ({"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    "prompt bool ids": ({"prompt": [True, 2]}, "prompt"),
    "a batch with an empty prompt": ({"prompt": ["a", ""]}, "prompt"),
    "a batch above the prompt limit": ({"prompt": ["a"] * 1025}, "prompt"),
    "a batch above the sequence limit": ({"prompt": ["a"] * 100, "n": 41}, None),
    "a batch too long in one prompt": ({"prompt": [[5], LONG]}, "prompt"),
    "a batch of resumable streams": ({"prompt": ["a", "b"], "stream": True, "stream_options": {"resumable": True}},
                                     None),
    "empty prompt": ({"prompt": ""}, "prompt"),
    "empty prompt list": ({"prompt": []}, "prompt"),
    "empty prompt in list": ({"prompt": [""]}, "prompt"),
    "out of vocab id": ({"prompt": [1, 100000]}, "prompt"),
    "negative id": ({"prompt": [-1]}, "prompt"),
    "max_tokens zero": ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    "max_tokens string": ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    "max_tokens float": ({"prompt": "hi", "max_tokens": 5.5}, "max_tokens"),
    "max_tokens bool": ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    "max_tokens huge": ({"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    "prompt + max_tokens too long": ({"prompt": [5] * 100, "max_tokens": MAX_POSITIONS - 99}, "max_tokens"),
    "temperature negative": ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    "temperature string": ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    "top_p zero": ({"prompt": "hi", "top_p": 0}, "top_p"),
    "top_p above one": ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    "top_k below -1": ({"prompt": "hi", "top_k": -2}, "top_k"),
    "n < 1": ({"prompt": "hi", "n": 0}, "n"),
    "n above the limit": ({"prompt": "hi", "n": 65}, "n"),
    "best_of below n": ({"prompt": "hi", "n": 3, "best_of": 1}, "best_of"),
    "best_of above the limit": ({"prompt": "hi", "best_of": 65}, "best_of"),
    "best_of > n streamed": ({"prompt": "hi", "best_of": 3, "stream": True}, None),
    "echo wrong type": ({"prompt": "hi", "echo": "yes"}, "echo"),
    "prompt_logprobs above the limit": ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    "logprobs above the limit": ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    "logprobs negative": ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    "stop wrong type": ({"prompt": "hi", "stop": 5}, "stop"),
    "stop list of ints": ({"prompt": "hi", "stop": [1]}, "stop"),
    "stop_token_ids out of vocab": ({"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
    "stream wrong type": ({"prompt": "hi", "stream": "yes"}, "stream"),
    "stream_options wrong type": ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
                                  "stream_options"),
    "seed too big": ({"prompt": "hi", "seed": 2**70}, "seed"),
    "presence_penalty above 2": ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty below -2": ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    "repetition_penalty zero": ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    "min_p above one": ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    "logit_bias key not a token id": ({"prompt": "hi", "logit_bias": {"hello": 1}}, "logit_bias"),
    "logit_bias above 100": ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    "logit_bias outside the vocabulary": ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    "invalid JSON schema": ({"prompt": "hi", "structured_outputs": {"json": {"type": "intger"}}}, "structured_outputs"),
    "invalid regex": ({"prompt": "hi", "guided_regex": "a(b"}, "guided_regex"),
    "two structured outputs": ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, None),
    "structured output with min_tokens": ({"prompt": "hi", "guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
    "ignore_eos wrong type": ({"prompt": "hi", "ignore_eos": "x"}, "ignore_eos"),
    "priority wrong type": ({"prompt": "hi", "priority": 1.5}, "priority"),
}


LENGTH_CASES = {"a batch too long in one prompt", "max_tokens huge", "prompt + max_tokens too long", "too long", "max_completion_tokens too long"}


@pytest.mark.parametrize("name", list(COMPLETION_CASES))
def test_completion_rejections(client, name):
    body, param = COMPLETION_CASES[name]
    code = "context_length_exceeded" if name in LENGTH_CASES else None
    assert_openai_error(client.post("/v1/completions", json=body), 400, param=param, code=code)


def test_prompt_too_long_says_so(client):
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": LONG}), 400, param="prompt",
                                code="context_length_exceeded")
    assert f"{MAX_POSITIONS - 1}" in error["message"]


def test_a_batch_names_its_failing_prompt(client):
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": ["a", "b", ""]}), 400, param="prompt")
    assert error["message"].startswith("prompt 2 of 3: ")


def test_malformed_json(client):
    response = client.post("/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert "JSON" in error["message"]


def test_body_not_an_object(client):
    assert_openai_error(client.post("/v1/completions", json=["prompt"]), 400)


def test_empty_body(client):
    assert_openai_error(client.post("/v1/completions", content=b"", headers={"content-type": "application/json"}),
                        400)


def test_unknown_model_is_404(client):
    error = assert_openai_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                                param="model", code="model_not_found")
    assert "gpt-9" in error["message"]


def test_oversize_body_is_413(client):
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, 413)


def test_oversize_chunked_body_is_413(client):
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()

    def chunks():  # no Content-Length: the limit applies while reading
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)


CHAT_CASES = {
    "messages missing": ({"model": "tiny"}, "messages"),
    "messages empty": ({"messages": []}, "messages"),
    "role unknown": ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    "content wrong type": ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    "message not an object": ({"messages": ["hi"]}, "messages"),
    "continue_final_message with add_generation_prompt": (
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, None),
    "chat_template_kwargs setting a request field": (
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs"),
    "chat_template_kwargs not an object": (
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    "continue_final_message wrong type": (
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": "yes"}, "continue_final_message"),
    "max_completion_tokens zero": ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
                                   "max_completion_tokens"),
    "max_completion_tokens too long": ({"messages": [{"role": "user", "content": "hi"}],
                                        "max_completion_tokens": MAX_POSITIONS}, "max_completion_tokens"),
    "top_logprobs without logprobs": ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
                                      "top_logprobs"),
    "top_logprobs above the limit": ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                      "top_logprobs": 21}, "top_logprobs"),
    "temperature negative": ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    "too long": ({"messages": [{"role": "user", "content": "word " * 200}]}, "prompt"),
    "tool_choice names no tool": ({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
    "functions": ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions"),
    "tool_choice required without tools": ({"messages": [{"role": "user", "content": "hi"}],
                                            "tool_choice": "required"}, None),
    "tool parameters schema invalid": ({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "intger"}}}],
        "tool_choice": "required"}, "tools"),
    "json_schema without schema": ({"messages": [{"role": "user", "content": "hi"}],
                                    "response_format": {"type": "json_schema"}}, "response_format"),
    "assistant tool call arguments not JSON": ({"messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                             "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages"),
}


@pytest.mark.parametrize("name", list(CHAT_CASES))
def test_chat_rejections(client, name):
    body, param = CHAT_CASES[name]
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, param=param,
                        code="context_length_exceeded" if name in LENGTH_CASES else None)


def test_text_the_tokenizer_cannot_take_is_400_and_reaches_no_worker(serve, fake_worker):
    """A lone surrogate is valid JSON ("\\ud800") but not text: 400, not the tokenizer's TypeError as a 500."""
    import httpx

    worker = fake_worker(token_script([5], "length"))
    server = serve()
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=server.url) as http:
        for route, body, param in [
            ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
            ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800b"}]}', "messages"),
        ]:
            error = assert_openai_error(http.post(route, content=body, headers=headers), 400, param=param)
            assert "cannot be tokenized" in error["message"]
    assert worker.requests == []


def test_unknown_route_and_method_have_the_error_shape(client):
    assert_openai_error(client.get("/v1/nothing"), 404, kind="not_found_error")
    assert_openai_error(client.get("/v1/completions"), 405)


def test_redis_unreachable_is_503_with_retry_after(client):
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert_openai_error(response, 503, kind="service_unavailable", code="redis_unavailable")
    assert response.headers["retry-after"] == "1"
    health = client.get("/health")
    assert health.status_code == 503 and "redis" in health.json()["reason"]


def test_no_decode_worker_is_503_with_retry_after(model_dir, redis_url, rclient):
    register_prefill(rclient)
    with TestClient(create_app(make_settings(model_dir, redis_url)), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        health = client.get("/health")
    assert_openai_error(response, 503, kind="service_unavailable", code="no_worker_available")
    assert response.headers["retry-after"] == "1"
    assert health.status_code == 503
    assert health.json()["reason"] == "no live decode worker" and health.json()["prefill_workers"] == 1


def test_bad_input_never_reaches_a_worker(serve, fake_worker, rclient):
    worker = fake_worker(token_script([5, 6], "length"))
    server = serve()
    import httpx

    with httpx.Client(base_url=server.url) as http:
        for name, (body, _param) in COMPLETION_CASES.items():
            assert http.post("/v1/completions", json=body).status_code == 400, name
        for name, (body, _param) in CHAT_CASES.items():
            assert http.post("/v1/chat/completions", json=body).status_code == 400, name
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert len(worker.requests) == 1


def test_an_invalid_structured_output_is_400_with_the_engine_message_and_reaches_no_worker(serve, fake_worker):
    import httpx

    worker = fake_worker(token_script([5], "length"))
    server = serve()
    with httpx.Client(base_url=server.url) as http:
        for body, param, words in [
            ({"prompt": "x", "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}},
             "structured_outputs", "nope"),
            ({"prompt": "x", "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "s", "schema": {"minLength": "3"}}}},
             "response_format", "minLength"),
            ({"prompt": "x", "guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
        ]:
            error = assert_openai_error(http.post("/v1/completions", json=body), 400, param=param)
            assert words in error["message"], error
    assert worker.requests == []
