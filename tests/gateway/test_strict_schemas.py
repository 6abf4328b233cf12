"""Object schemas without additionalProperties admit their declared keys only, each once
(tandem.cluster.strict_schemas), for response_format / structured_outputs and forced tool calls
alike; structured_outputs.disable_additional_properties false keeps JSON Schema's reading."""

import copy
import json

import pytest
from llguidance import LLMatcher

from tandem.cluster import grammars
from tandem.cluster.strict_schemas import close_objects
from tandem.engine.demo_model import make_tiny_tokenizer
from tandem.gateway import tools
from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.protocol import CompletionRequest

# what pydantic writes for a four-field model (and instructor sends as a tool's parameters):
# titles everywhere, no additionalProperties, a nested model under $defs
USER = {
    "$defs": {"Address": {"properties": {"city": {"title": "City", "type": "string"}},
                          "required": ["city"], "title": "Address", "type": "object"}},
    "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"},
                   "email": {"title": "Email", "type": "string"},
                   "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "age", "email", "address"], "title": "UserDetail", "type": "object",
}
GOOD = '{"name":"Jane","age":31,"email":"jane@doe.org","address":{"city":"Berlin"}}'


@pytest.fixture(scope="module")
def ll():
    tokenizer = make_tiny_tokenizer()
    return tokenizer, grammars.ll_tokenizer(tokenizer, len(tokenizer))


def _accepts(ll, grammar: str, text: str) -> bool:
    tokenizer, ll_tokenizer = ll
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_a_pydantic_schema_admits_its_fields_only_and_each_once(ll):
    grammar = grammars.json_schema_grammar(USER)
    assert _accepts(ll, grammar, GOOD)
    assert not _accepts(ll, grammar, GOOD[:-1] + ',"title":"x"}')  # a key the schema does not declare
    assert not _accepts(ll, grammar, GOOD.replace('"city":"Berlin"', '"city":"Berlin","zip":"1"'))  # nested too
    assert not _accepts(ll, grammar, '{"name":"Jane","name":"Joe","age":31,"email":"e","address":{"city":"B"}}')
    permissive = grammars.json_schema_grammar(USER, closed=False)
    assert _accepts(ll, permissive, GOOD[:-1] + ',"title":"x","title":"y"}')  # JSON Schema's own reading


def test_the_input_is_left_alone_and_what_says_otherwise_is_kept():
    schema = copy.deepcopy(USER)
    closed = close_objects(schema)
    assert schema == USER and closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    assert close_objects(True) is True and close_objects({"type": "object"}) == {"type": "object"}  # free-form map
    typed = {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(typed) == typed
    patterned = {"properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert close_objects(patterned) == patterned
    # the property named "properties" is a property, not a keyword: its schema is closed, the map is not
    odd = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}}}
    assert close_objects(odd)["properties"]["properties"]["additionalProperties"] is False
    assert set(close_objects(odd)["properties"]) == {"properties"}
    listed = {"type": "array", "items": {"properties": {"a": {}}}, "prefixItems": [{"properties": {"b": {}}}]}
    assert close_objects(listed)["items"]["additionalProperties"] is False
    assert close_objects(listed)["prefixItems"][0]["additionalProperties"] is False
    optional = {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}], "$defs": {"A": {"properties": {"a": {}}}}}
    assert close_objects(optional)["$defs"]["A"]["additionalProperties"] is False


def test_an_object_spread_over_parts_stays_open_at_its_top(ll):
    base = {"$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
            "allOf": [{"$ref": "#/$defs/Base"},
                      {"type": "object", "properties": {"b": {"type": "integer"},
                                                        "inner": {"properties": {"c": {"type": "integer"}}}}}]}
    closed = close_objects(base)
    assert "additionalProperties" not in closed["$defs"]["Base"] and "additionalProperties" not in closed["allOf"][1]
    assert closed["allOf"][1]["properties"]["inner"]["additionalProperties"] is False  # its own nested object
    grammar = grammars.json_schema_grammar(base)
    assert _accepts(ll, grammar, '{"a":1,"b":2}')
    beside = {"properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": {"type": "integer"}}}]}
    assert close_objects(beside) == beside
    wrapped = {"properties": {"x": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$defs": {"A": {"properties": {"a": {}}}}}
    assert close_objects(wrapped)["$defs"]["A"]["additionalProperties"] is False  # one member: not spread


def test_forced_tool_calls_take_the_declared_arguments_only(ll):
    function = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "UserDetail", "parameters": USER}}]}).tools[0].function
    grammar = grammars.lark_grammar(tools.forced_grammar("hermes", [function], parallel=False))
    call = '<tool_call>\n{"name":"UserDetail","arguments":%s}\n</tool_call>'
    assert _accepts(ll, grammar, call % GOOD)
    assert not _accepts(ll, grammar, call % (GOOD[:-1] + ',"title":"UserDetail"}'))
    assert function.parameters == USER  # the request itself is not changed


def test_structured_outputs_may_ask_for_the_permissive_reading():
    body = CompletionRequest.model_validate({"prompt": "hi", "structured_outputs": {
        "json": USER, "disable_additional_properties": False}})
    assert body.structured.disable_additional_properties is False
    for asked in ({"prompt": "hi", "structured_outputs": {"json": USER}},
                  {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": USER}}}):
        assert CompletionRequest.model_validate(asked).structured.disable_additional_properties is True
    with pytest.raises(ValueError):  # a bool, as every field of the API is strict
        CompletionRequest.model_validate({"prompt": "hi", "structured_outputs": {
            "json": USER, "disable_additional_properties": "no"}})
    assert json.loads(json.dumps(USER)) == USER


def test_each_functions_own_defs_resolve_in_a_forced_call(ll):
    """pydantic puts nested models under the parameters' $defs, referred to from the schema's root:
    inside the call's schema each function's references still reach its own definitions."""
    other = {"$defs": {"Address": {"properties": {"zip": {"type": "integer"}}, "required": ["zip"]}},
             "properties": {"where": {"$ref": "#/$defs/Address"}}, "required": ["where"]}
    request = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "UserDetail", "parameters": USER}},
                  {"type": "function", "function": {"name": "Parcel", "parameters": other}}]})
    functions = [t.function for t in request.tools]
    grammar = grammars.lark_grammar(tools.forced_grammar("hermes", functions, parallel=True))
    call = '<tool_call>\n{"name":"%s","arguments":%s}\n</tool_call>'
    assert _accepts(ll, grammar, call % ("UserDetail", GOOD) + "\n" + call % ("Parcel", '{"where":{"zip":1}}'))
    assert not _accepts(ll, grammar, call % ("Parcel", '{"where":{"city":"Berlin"}}'))  # not UserDetail's Address
