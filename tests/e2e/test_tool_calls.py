"""Tool calls through the whole CPU cluster, with the openai client, for each call format:
a call forced by tool_choice, its result sent back as a tool message, a final answer,
streamed and not. Each model's chat template renders tools in its own format (the
tests write the templates: Hermes/Qwen2.5's <tool_call>, Llama 3's JSON with ipython,
Mistral's [TOOL_CALLS] special token)."""

import json
import os

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tandem.engine.demo_model import make_tiny_checkpoint
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

HERMES = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{%- if tools %}<|start_header_id|>system<|end_header_id|>
Environment: ipython
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>
{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>
{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>
{{ message.content }}<|eot_id|>{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>
{% endif %}"""

MISTRAL = """{%- for message in messages %}
{%- if message.role == "user" %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | map(attribute='function') | list | tojson }}</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>{% endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
        "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
RESULT = "sunny and 21 degrees"


def _checkpoint(base, parser: str) -> str:
    path = make_tiny_checkpoint(base / parser, "llama", max_position_embeddings=2048)  # tools are long in a tiny vocabulary
    tokenizer = AutoTokenizer.from_pretrained(path)
    if parser == "mistral":
        tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.chat_template = TEMPLATES[parser]
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(TEMPLATES))
def tool_cluster(request, tmp_path_factory):
    path = _checkpoint(tmp_path_factory.mktemp("models"), request.param)
    c = LocalCluster(path, str(tmp_path_factory.mktemp("logs")), tokens_per_block=4, max_num_tokens=64,
                     max_seq_len=2048, max_input_len=1800).start()
    yield request.param, path, c
    c.stop()


def _check_call(call, name=None):
    assert call.type == "function" and call.id
    if name is not None:
        assert call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _stream_message(stream):
    """A streamed chat response -> (content, tool calls as dicts, finish_reason), from OpenAI's deltas."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_round_trip(tool_cluster, stream):
    parser, path, cluster = tool_cluster
    if parser != "hermes" and not stream:
        pytest.skip("whole responses: the hermes format's, and every format's parser in tests/gateway/test_tool_parsers.py")
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    model = os.path.basename(path)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=model, tools=[WEATHER, TIME], tool_choice=forced, temperature=1.0, seed=4, max_tokens=120)
    if stream:
        content, calls, finish = _stream_message(client.chat.completions.create(messages=messages, stream=True,
                                                                                 **kwargs))
        assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
    else:
        response = client.chat.completions.create(messages=messages, **kwargs)
        choice = response.choices[0]
        finish = choice.finish_reason
        assert choice.message.tool_calls and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        _check_call(call, "get_weather")
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    assert finish == "tool_calls"
    # the call and its result go back through the template; the model answers in text
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                           temperature=0.0, max_tokens=8, extra_body={"return_token_ids": True})
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    prompt = AutoTokenizer.from_pretrained(path).decode(final.model_extra["prompt_token_ids"])
    assert RESULT in prompt and json.loads(arguments)["city"] in prompt  # both went through the template


def test_required_calls_one_of_the_tools(tool_cluster):
    """tool_choice required without parallel calls: exactly one call, to either tool (several
    calls in one answer, parallel_tool_calls' default, are tests/gateway/test_tool_parsers.py's:
    a random model would chain calls until max_tokens)."""
    parser, path, cluster = tool_cluster
    if parser != "hermes":
        pytest.skip("the forced grammar of every format: tests/gateway/test_tool_parsers.py")
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    response = client.chat.completions.create(
        model=os.path.basename(path), messages=[{"role": "user", "content": "Weather and time in Oslo?"}],
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=9,
        max_tokens=200, n=6)
    names = set()
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0])
        names.add(choice.message.tool_calls[0].function.name)
    assert names <= {"get_weather", "get_time"}


def test_auto_reads_a_call_the_model_writes_and_leaves_text_alone(tool_cluster):
    """tool_choice auto: free text that holds no call stays content (reading calls out of free
    text, streamed and whole, is tests/gateway/test_tool_parsers.py's)."""
    parser, path, cluster = tool_cluster
    if parser != "hermes":
        pytest.skip("free text is read the same way in every format: tests/gateway/test_tool_parsers.py")
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    model = os.path.basename(path)
    text = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          tools=[WEATHER], temperature=0.0, max_tokens=6)
    assert text.choices[0].message.tool_calls is None and text.choices[0].finish_reason in ("stop", "length")
