"""Tool-call formats: reading calls out of whole and streamed outputs, and the grammars that force
them (checked with llguidance itself on a real tokenizer)."""

import json
from types import SimpleNamespace

import pytest
from llguidance import LLMatcher

from tandem.cluster import grammars
from tandem.engine.demo_model import make_tiny_tokenizer
from tandem.gateway import tools
from tandem.gateway.chat_protocol import ChatCompletionRequest

CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": 2})]


def _written(parser: str, calls=CALLS, compact: bool = False) -> str:
    """Calls as a model trained on ``parser``'s format writes them (``compact``: as the forcing
    grammar lets it, no whitespace inside the JSON)."""
    dumps = (lambda v: json.dumps(v, separators=(",", ":"))) if compact else json.dumps
    if parser == "hermes":
        return "\n".join(f'<tool_call>\n{dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    if parser == "llama3_json":
        return ("" if compact else "<|python_tag|>") + "; ".join(dumps({"name": n, "parameters": a}) for n, a in calls)
    return "[TOOL_CALLS][" + ", ".join(dumps({"name": n, "arguments": a}) for n, a in calls) + "]"


@pytest.mark.parametrize("parser", tools.PARSERS)
def test_whole_output_calls_are_read(parser):
    content, calls = tools.parse(parser, _written(parser))
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("parser", tools.PARSERS)
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_output_gives_the_same_calls_and_content(parser, piece):
    lead = "Let me check. " if parser == "hermes" else ""
    text = lead + _written(parser)
    reader, content, calls = tools.ToolCallReader(parser), "", []
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    for i, p in enumerate(pieces):
        c, found = reader.feed(p, final=i == len(pieces) - 1)
        content += c
        calls += found
    assert content.strip() == lead.strip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS


@pytest.mark.parametrize("parser", tools.PARSERS)
def test_text_without_calls_stays_content(parser):
    for text in ["Hello there", "{not json", "<tool_call>\nnope\n</tool_call>", "[1, 2, 3]"]:
        content, calls = tools.parse(parser, text)
        assert calls == [] and content == text
        reader = tools.ToolCallReader(parser)
        streamed = "".join(reader.feed(ch)[0] for ch in text) + reader.feed("", final=True)[0]
        assert streamed == text


def test_hermes_content_streams_before_a_call_and_holds_back_a_partial_opener():
    reader = tools.ToolCallReader("hermes")
    assert reader.feed("Checking <tool") == ("Checking ", [])
    assert reader.feed("_cal") == ("", [])
    content, calls = reader.feed('l>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert content == "" and [c.name for c in calls] == ["f"]
    assert reader.feed(" done.", final=True) == (" done.", [])


def test_parser_is_configured_or_told_by_the_template():
    assert tools.parser_for("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tools.parser_for("<|start_header_id|>ipython") == "llama3_json"
    assert tools.parser_for("<tool_call>") == "hermes"
    assert tools.parser_for(None) == "hermes"
    assert tools.parser_for("<tool_call>", "llama3_json") == "llama3_json"
    with pytest.raises(ValueError):
        tools.parser_for("", "nope")


FUNCTIONS = [SimpleNamespace(name="get_weather", parameters={
                 "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                 "required": ["city", "unit"], "additionalProperties": False}),
             SimpleNamespace(name="get_time", parameters={
                 "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"],
                 "additionalProperties": False})]


@pytest.fixture(scope="module")
def ll_tokenizer():
    tokenizer = make_tiny_tokenizer()
    return tokenizer, grammars.ll_tokenizer(tokenizer, len(tokenizer))


def _accepts(ll, tokenizer, grammar: str, text: str) -> bool:
    matcher = LLMatcher(ll, grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and (matcher.consume_tokens(ids) and matcher.is_accepting())


@pytest.mark.parametrize("parser", tools.PARSERS)
def test_forced_grammar_takes_valid_calls_only(parser, ll_tokenizer):
    tokenizer, ll = ll_tokenizer
    one, two = _written(parser, CALLS[:1], compact=True), _written(parser, CALLS, compact=True)
    single = grammars.lark_grammar(tools.forced_grammar(parser, FUNCTIONS, parallel=False))
    parallel = grammars.lark_grammar(tools.forced_grammar(parser, FUNCTIONS, parallel=True))
    assert LLMatcher.validate_grammar(parallel, ll) == ""
    assert _accepts(ll, tokenizer, single, one), one
    assert not _accepts(ll, tokenizer, single, two)
    assert _accepts(ll, tokenizer, parallel, two), two
    assert not _accepts(ll, tokenizer, parallel, one.replace("celsius", "kelvin"))  # outside the enum
    assert not _accepts(ll, tokenizer, parallel, one.replace('"Paris"', '"Paris","x":1'))  # no extra keys
    named = grammars.lark_grammar(tools.forced_grammar(parser, FUNCTIONS[1:], parallel=False))
    assert not _accepts(ll, tokenizer, named, one)  # get_weather is not the named function
    for text in (one, two):  # what the grammar lets through, the parser reads back
        assert [c.name for c in tools.parse(parser, text)[1]] == [n for n, _ in CALLS[:text.count('"name"')]]


def _chat(**extra):
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, words", [
    (_chat(tool_choice="required"), "needs tools"),
    (_chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "not in tools"),
    (_chat(tools=[TOOL, TOOL]), "distinct"),
    (_chat(tools=[TOOL], response_format={"type": "json_object"}), "cannot be asked for together"),
    (_chat(tools=[TOOL], stream=True, stream_options={"resumable": True}), "resumable"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "not JSON"),
])
def test_bad_tool_requests_are_refused(body, words):
    with pytest.raises(ValueError, match=words):
        ChatCompletionRequest.model_validate(body)
