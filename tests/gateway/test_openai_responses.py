"""OpenAI's Responses API through the official client and plain HTTP: the request is the chat
completion it describes (its prompt the chat template's), the answer the ``response`` object or the
API's typed events in order, a cut answer ``incomplete``, and what a text server cannot honour a 400
naming its field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.conftest import TEXT, post, register_prefill, token_script

openai = pytest.importorskip("openai")

STREAM_TYPES = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
END_TYPES = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_chat_completion_it_describes(serve, fake_worker, rclient, tokenizer, text_ids):
    worker = fake_worker(token_script(text_ids + [2], "stop"))
    register_prefill(rclient)
    server = serve()
    client = _client(server)
    answer = client.responses.create(model="tiny", instructions="Be brief.", input="Say hello", max_output_tokens=50)
    assert answer.status == "completed" and answer.output_text == TEXT and answer.incomplete_details is None
    assert answer.output[0].role == "assistant" and answer.id.startswith("resp-")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(expected, add_special_tokens=False)
    assert worker.requests[-1].prompt_token_ids == prompt_ids and worker.requests[-1].max_tokens == 50
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (len(prompt_ids), len(text_ids) + 1)

    items = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text",
                                                                                         "text": "Say hello"}]}]
    events = list(client.responses.create(model="tiny", input=items, stream=True))
    assert worker.requests[-1].prompt_token_ids == prompt_ids
    types = [e.type for e in events]
    assert types[:4] == STREAM_TYPES and types[-4:] == END_TYPES + ["response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    assert events[-1].response.output_text == TEXT and events[-1].response.usage.output_tokens == len(text_ids) + 1


def test_a_cut_answer_is_incomplete_and_a_format_is_a_structured_output(serve, fake_worker, rclient, text_ids):
    worker = fake_worker(token_script(text_ids[:3], "length"))
    register_prefill(rclient)
    server = serve()
    body = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 3}).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    with httpx.stream("POST", server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 3,
                                                                   "stream": True}, timeout=20) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-2] == "event: response.incomplete"
    assert json.loads(lines[-1][len("data: "):])["response"]["status"] == "incomplete"
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    post(server, "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                       "schema": schema}}})
    assert worker.requests[-1].sampling.grammar is not None and worker.requests[0].sampling.grammar is None


def test_what_a_text_server_cannot_honour_is_refused(serve):
    server = serve()
    cases = [({"input": "x", "store": True}, "store"), ({"input": "x", "previous_response_id": "resp_1"},
                                                        "previous_response_id"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"), ({"input": ""}, "input"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
             ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
             ({"input": "x", "temperature": -1}, "temperature"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "intger"}}}}, "text")]
    for body, param in cases:
        response = post(server, "/v1/responses", body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    assert post(server, "/v1/responses", {"input": "x", "model": "nope"}).status_code == 404
