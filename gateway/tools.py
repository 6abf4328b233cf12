"""Tool calls on chat: the formats models write them in, read back into OpenAI's ``tool_calls``.

A parser knows one format:

- ``hermes`` (Hermes, Qwen2.5 and most ChatML models):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}``, calls joined by
  ``"; "``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

``--tool-call-parser`` picks one; otherwise the chat template tells (the marker it
renders). With ``tool_choice`` "required" or a named function the output is forced:
``forced_grammar`` is a Lark grammar (llguidance's dialect, ``%json`` for the arguments)
that only lets the model write calls in its parser's format, to the tools' names, with
arguments valid for each function's schema (its objects closed:
``tandem.cluster.strict_schemas``; its own ``$defs`` resolved where it sits in the call's
schema). ``tool_choice`` "auto" leaves the model free and reads whatever calls it wrote.

``ToolCallReader`` turns one choice's text deltas into content deltas and whole calls:
content streams as it comes (minus any text that may still open a call); a call goes
out once its text is complete (the stream's chunk carries its name and arguments at
once, which OpenAI's stream shape allows: clients concatenate argument pieces).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.strict_schemas import close_objects
from tandem.gateway.responses import ChoiceResult, Delta

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parser_for(template: str | None, configured: str | None = None) -> str:
    """The parser ``--tool-call-parser`` names, else the one the chat template's markers tell."""
    if configured:
        if configured not in PARSERS:
            raise ValueError(f"unknown tool call parser {configured!r}: one of {', '.join(PARSERS)}")
        return configured
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


# ---- forced calls: the grammar ----------------------------------------------------------

# keywords whose value is data, not a schema (a "$ref" key in there is no reference), and those
# whose value maps names to schemas (any name, "$ref" too)
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rebased(node: Any, base: str) -> Any:
    """A copy of a schema whose local references (``#...``) point below ``base`` (a JSON pointer):
    where the schema sits in the call's schema, so its ``$defs`` (pydantic's nested models) resolve."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + base + value[1:]
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = value if key in _DATA_KEYWORDS else _rebased(value, base)
    return out


def _call_schema(parser: str, function, index: int, defs: dict) -> dict:
    """The schema of one call to ``function``; its arguments' schema goes into ``defs`` (the
    grammar's root ``$defs``) as ``f<index>``, its references rebased there."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    parameters = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
    parameters = close_objects(parameters)  # the declared arguments only, as for response_format
    defs[f"f{index}"] = _rebased(parameters, f"/$defs/f{index}")
    return {"type": "object", "properties": {"name": {"const": function.name}, key: {"$ref": f"#/$defs/f{index}"}},
            "required": ["name", key], "additionalProperties": False}


def forced_grammar(parser: str, functions: list, parallel: bool, special_token_id=None) -> str:
    """A Lark grammar: one call (or, with ``parallel``, one or more) to one of ``functions``, in
    ``parser``'s format. ``special_token_id(text)``: the id of a marker the tokenizer has as one
    special token (it is then matched as that token: its text is not what the model writes)."""
    defs: dict[str, Any] = {}
    schemas = [_call_schema(parser, f, i, defs) for i, f in enumerate(functions)]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["$defs"] = defs
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact arguments: no whitespace to spin in
    call_json = "%json " + json.dumps(schema, separators=(",", ":"))
    if parser == "hermes":
        call = f'"<tool_call>\\n" {call_json} "\\n</tool_call>"'
        rules = [f"call: {call}", 'start: call ("\\n" call)*' if parallel else "start: call"]
    elif parser == "llama3_json":
        rules = [f"call: {call_json}", 'start: call ("; " call)*' if parallel else "start: call"]
    else:
        token = special_token_id("[TOOL_CALLS]") if special_token_id else None
        marker = f"<[{token}]>" if token is not None else '"[TOOL_CALLS]"'
        calls = 'call (", " call)*' if parallel else "call"
        rules = [f"call: {call_json}", f'start: {marker} "[" {calls} "]"']
    return "\n".join(rules)


# ---- reading calls out of the text -------------------------------------------------------

def _decode_objects(text: str) -> list[Any] | None:
    """Every JSON value in ``text``, separated by whitespace, ',' or ';' (None: not all JSON)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,;":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _calls_of(values: list[Any], key: str) -> list[Call] | None:
    calls = []
    for value in values:
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                return None
            arguments = item.get(key, item.get("arguments", item.get("parameters", {})))
            calls.append(Call(item["name"], arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)))
    return calls


def parse(parser: str, text: str) -> tuple[str, list[Call]]:
    """A whole output -> (its content, its calls). Text that does not parse stays content."""
    if parser == "hermes":
        content, calls, rest = [], [], text
        while "<tool_call>" in rest:
            before, _, after = rest.partition("<tool_call>")
            body, closed, rest = after.partition("</tool_call>")
            found = _calls_of(_decode_objects(body) or [], "arguments")
            if not found:
                content.append(before + "<tool_call>" + body + ("</tool_call>" if closed else ""))
                continue
            content.append(before)
            calls += found
        content.append(rest)
        return "".join(content).strip() if calls else text, calls
    marker = "[TOOL_CALLS]" if parser == "mistral" else "<|python_tag|>"
    start = text.find(marker)
    head, body = (text[:start], text[start + len(marker):]) if start >= 0 else ("", text)
    if parser == "mistral" and start < 0:
        return text, []
    stripped = body.strip()
    if not stripped.startswith(("{", "[")):
        return text, []
    values = _decode_objects(stripped)
    calls = _calls_of(values, "arguments" if parser == "mistral" else "parameters") if values else None
    if not calls:
        return text, []
    return head.strip(), calls


class ToolCallReader:
    """One choice's text, delta by delta -> (content to send now, calls complete now)."""

    def __init__(self, parser: str):
        self.parser = parser
        self.opener = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(parser)
        self._text = ""  # everything so far
        self._sent = 0  # content sent: self._text[:_sent]
        self._calls_out = 0
        self._in_calls = False  # llama3_json / mistral: the output turned out to be calls

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[Call]]:
        self._text += delta
        if self.parser == "hermes":
            return self._feed_hermes(final)
        return self._feed_whole(final)

    def _feed_hermes(self, final: bool) -> tuple[str, list[Call]]:
        content, calls = self._parse_done_blocks()
        pending = self._text[self._sent:]
        opened = pending.find("<tool_call>")
        # an open block is held back whole; otherwise only an end that may begin the opener
        ready = opened if opened >= 0 else len(pending) - _partial_suffix(pending, "<tool_call>")
        content += pending[:ready]
        self._sent += ready
        if final and self._sent < len(self._text):
            rest = self._text[self._sent:]
            rest_content, rest_calls = parse("hermes", rest)
            content += rest_content if rest_calls else rest
            calls += rest_calls
            self._sent = len(self._text)
        return content, calls

    def _parse_done_blocks(self) -> tuple[str, list[Call]]:
        content, calls = "", []
        while True:
            pending = self._text[self._sent:]
            start = pending.find("<tool_call>")
            end = pending.find("</tool_call>", start)
            if start < 0 or end < 0:
                return content, calls
            block = pending[: end + len("</tool_call>")]
            text, found = parse("hermes", block)
            if found:
                content += pending[:start]
                calls += found
                self._calls_out += len(found)
            else:
                content += block
            self._sent += len(block)

    def _feed_whole(self, final: bool) -> tuple[str, list[Call]]:
        stripped = self._text.lstrip()
        if not self._in_calls:
            markers = [m for m in (self.opener, "<|python_tag|>" if self.parser == "llama3_json" else None,
                                   "{" if self.parser == "llama3_json" else None) if m]
            if any(stripped.startswith(m) for m in markers):
                self._in_calls = True
            elif stripped and any(m.startswith(stripped) for m in markers):
                return "", []  # could still become a call
            elif stripped or final:
                content = self._text[self._sent:]
                self._sent = len(self._text)
                return content, []
            else:
                return "", []
        if not final:
            return "", []
        content, calls = parse(self.parser, self._text)
        if not calls:
            content = self._text
        self._sent = len(self._text)
        self._calls_out += len(calls)
        return content, calls


def _partial_suffix(text: str, word: str) -> int:
    """The length of the longest end of ``text`` that begins ``word`` (0: none)."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


# ---- rendering tools for templates that do not ---------------------------------------------

def tools_system_prompt(parser: str, tools: list[dict]) -> str:
    """For a chat template without tools: a system message that lists them and the call format
    ``parser`` reads (as Hermes-style templates render it)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if parser == "llama3_json":
        how = ('To call a function, reply with only a JSON object {"name": <function name>, '
               '"parameters": <arguments object>}.')
    elif parser == "mistral":
        how = ('To call functions, reply with [TOOL_CALLS] followed by a JSON list of '
               '{"name": <function name>, "arguments": <arguments object>}.')
    else:
        how = ('For each function call, return a JSON object with the function name and arguments within '
               '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
               '</tool_call>')
    return f"You may call one or more functions to assist with the user query.\n\n<tools>\n{listing}\n</tools>\n\n{how}"


def render_calls(parser: str, calls: list[dict]) -> str:
    """An assistant's earlier calls (OpenAI's shape, arguments as mappings) in ``parser``'s format,
    for templates that render no tool calls of their own."""
    items = [{"name": c["function"]["name"], ("parameters" if parser == "llama3_json" else "arguments"):
              c["function"]["arguments"]} for c in calls]
    if parser == "llama3_json":
        return "; ".join(json.dumps(i, ensure_ascii=False) for i in items)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps(items, ensure_ascii=False)
    return "\n".join(f"<tool_call>\n{json.dumps(i, ensure_ascii=False)}\n</tool_call>" for i in items)


# ---- responses: calls read out of the choices ---------------------------------------------

def _finish(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def read_results(parser: str, results: list[ChoiceResult]) -> list[ChoiceResult]:
    """Finished choices with their calls read out: content, ``tool_calls``, finish "tool_calls"."""
    out = []
    for result in results:
        content, calls = parse(parser, result.text)
        out.append(dataclasses.replace(result, text=content if calls else result.text,
                                       tool_calls=[c.to_dict() for c in calls] or None,
                                       finish_reason=_finish(result.finish_reason, bool(calls))))
    return out


async def read_deltas(parser: str, deltas: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Streamed choices with their calls read out as they complete (tool-call deltas, indexed per
    choice from 0); the finish of a choice that called a tool is "tool_calls"."""
    readers: dict[int, ToolCallReader] = {}
    counts: dict[int, int] = {}
    async for index, delta in deltas:
        reader = readers.setdefault(index, ToolCallReader(parser))
        content, calls = reader.feed(delta.text, final=delta.finish_reason is not None)
        first = counts.get(index, 0)
        counts[index] = first + len(calls)
        yield index, dataclasses.replace(
            delta, text=content, tool_calls=[c.to_dict(first + i) for i, c in enumerate(calls)] or None,
            finish_reason=_finish(delta.finish_reason, counts[index] > 0))
