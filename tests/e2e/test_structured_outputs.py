"""Structured outputs through the whole CPU cluster: every sampled output obeys its schema,
regex or choice, the openai client's ``parse`` works, and a guided stream whose decode
worker is killed still ends as valid JSON continuing what it streamed."""

import json
import os
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 8},
                "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                             "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                            "required": ["city", "zip"], "additionalProperties": False},
            }, "required": ["name", "address"], "additionalProperties": False},
        },
        "required": ["user"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3, None]}},
        "required": ["color", "size"], "additionalProperties": False,
    },
    "bounded arrays": {
        "type": "array", "minItems": 2, "maxItems": 4,
        "items": {"type": "string", "maxLength": 4},
    },
    "number ranges": {
        "type": "object",
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "delta": {"type": "number", "exclusiveMinimum": -5, "exclusiveMaximum": 5}},
        "required": ["ratio", "year", "delta"], "additionalProperties": False,
    },
    "required fields": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 1000}, "ok": {"type": "boolean"},
                       "note": {"type": "string", "maxLength": 6}},
        "required": ["id", "ok"], "additionalProperties": False,  # "note" optional, no other keys
    },
}
NUM_SAMPLES = 50
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def guided_cluster(tiny_llama, tmp_path_factory):
    c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp("logs")), tokens_per_block=4, max_num_tokens=32,
                     max_seq_len=512, max_input_len=200, max_batch_size=64, decode_run_ahead="on").start()
    yield c
    c.stop()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_output_obeys_its_json_schema(guided_cluster, name):
    schema = SCHEMAS[name]
    body = {"messages": [{"role": "user", "content": f"Reply with {name} as JSON."}], "n": NUM_SAMPLES,
            "temperature": 1.0, "seed": 7, "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    resp = httpx.post(f"{guided_cluster.base_url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == NUM_SAMPLES
    texts = set()
    for choice in choices:
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (choice["finish_reason"], text)
        jsonschema.validate(json.loads(text), schema)
        assert text == text.strip() and "\n" not in text  # compact: no whitespace to spin in
        texts.add(text)
    if name != "enums":  # 12 possible values: repeats are expected there
        assert len(texts) > NUM_SAMPLES // 2, "sampling at temperature 1 should vary"


def test_json_object_regex_and_choice(guided_cluster):
    url = f"{guided_cluster.base_url}/v1/completions"
    resp = httpx.post(url, json={"prompt": "An object:", "max_tokens": MAX_TOKENS, "n": 8, "temperature": 1.0,
                                 "seed": 3, "response_format": {"type": "json_object"}}, timeout=120)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        if choice["finish_reason"] == "stop":  # free-form objects can be long; a finished one is valid
            assert isinstance(json.loads(choice["text"]), dict)
    resp = httpx.post(url, json={"prompt": "A code:", "max_tokens": 20, "n": 16, "temperature": 1.0, "seed": 1,
                                 "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}}, timeout=120)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", choice["text"]), choice
    options = ["yes", "no", "it depends on the weather"]
    resp = httpx.post(url, json={"prompt": "Answer:", "max_tokens": 20, "n": 16, "temperature": 1.0, "seed": 2,
                                 "structured_outputs": {"choice": options}}, timeout=120)
    assert {c["text"] for c in resp.json()["choices"]} <= set(options)
    # vLLM's older name with a Lark grammar, and a GBNF one
    for grammar in ('start: "a" bc bc? bc? "d"\nbc: "b" | "c"', 'root ::= "a" [bc] [bc]? "d"'):
        resp = httpx.post(url, json={"prompt": "Answer:", "max_tokens": 20, "temperature": 1.0, "n": 8,
                                     "guided_grammar": grammar}, timeout=120)
        for choice in resp.json()["choices"]:
            assert re.fullmatch("a[bc]{1,3}d", choice["text"]) and choice["finish_reason"] == "stop", resp.text


def test_invalid_schema_or_grammar_is_a_400_before_any_worker(guided_cluster):
    url = f"{guided_cluster.base_url}/v1/completions"
    cases = [({"structured_outputs": {"json": {"type": "intger"}}}, "intger"),
             ({"structured_outputs": {"regex": "a(b"}}, "unclosed group"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "no"}}}},
              "minimum"),
             ({"structured_outputs": {"grammar": "start: missing_rule"}}, "missing_rule")]
    for extra, words in cases:
        resp = httpx.post(url, json={"prompt": "x", "max_tokens": 5, **extra}, timeout=60)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error", error


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: str = pydantic.Field(pattern="^(cat|dog|fish)$")
    legs: int = pydantic.Field(ge=0, le=4)


def test_openai_client_parse_with_a_pydantic_model(guided_cluster, tiny_llama):
    client = openai.OpenAI(base_url=f"{guided_cluster.base_url}/v1", api_key="unused")
    completion = client.chat.completions.parse(
        model=os.path.basename(tiny_llama), messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet, temperature=1.0, seed=11, max_tokens=MAX_TOKENS,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet), completion
    assert pet.kind in ("cat", "dog", "fish") and 0 <= pet.legs <= 4


LONG_SCHEMA = {"type": "array", "minItems": 60, "maxItems": 60,
               "items": {"type": "integer", "minimum": 0, "maximum": 999}}


def test_guided_stream_survives_its_decode_worker_being_killed(two_decode_cluster, tiny_llama):
    cluster = two_decode_cluster
    body = {"model": os.path.basename(tiny_llama), "prompt": "Sixty numbers:", "max_tokens": 480,
            "temperature": 1.0, "seed": 5, "stream": True, "structured_outputs": {"json": LONG_SCHEMA}}
    text, finish, killed, pieces_at_kill = "", None, None, 0
    with httpx.Client(timeout=180) as client, client.stream("POST", f"{cluster.base_url}/v1/completions",
                                                            json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            assert "error" not in payload, payload
            choice = payload["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if killed is None and text.count(",") >= 10:
                killed = cluster.kill_busy_worker("decode", lambda: True, timeout_s=0.5)
                pieces_at_kill = text.count(",")
    assert killed is not None, "the request finished before a decode worker could be killed"
    assert pieces_at_kill < 59, "killed too late to prove anything"
    assert finish == "stop", text
    values = json.loads(text)  # the streamed prefix and what the other worker added: one valid document
    jsonschema.validate(values, LONG_SCHEMA)
