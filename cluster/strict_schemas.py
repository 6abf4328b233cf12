"""Closed objects: the reading of a JSON schema that structured outputs use by default.

JSON Schema lets an object without ``additionalProperties`` hold any other key besides its
``properties``, and the grammar engine follows the letter (any further key, the same one again
and again). The schemas clients generate (pydantic's, so instructor's and most tool
definitions) leave ``additionalProperties`` out meaning "these fields", and a small model given
that room writes key after key until ``max_tokens``. ``close_objects`` reads such a schema as
xgrammar's default and OpenAI's structured outputs do: every object schema that lists
``properties`` and says nothing of other keys (no ``additionalProperties``,
``patternProperties`` or ``unevaluatedProperties``) gets ``"additionalProperties": false``, so
it admits its declared keys only, each at most once (llguidance writes them in the schema's
order).

An object whose keys are spread over several parts is left open at its top, since closing a part
would refuse the keys of the others: ``properties`` beside ``allOf`` / ``anyOf`` / ``oneOf`` or a
``$ref``, an ``allOf`` of several members, and the ``$defs`` such parts refer to. Their own
nested objects are closed as anywhere else. An object schema that lists no ``properties``
(``{"type": "object"}``: a free-form map) stays open.

Plain Python on plain JSON values; the input is never changed (a copy comes back).
"""

from __future__ import annotations

from typing import Any

OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
COMPOSITIONS = ("allOf", "anyOf", "oneOf")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
                 "unevaluatedProperties", "unevaluatedItems")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas admit only their declared properties."""
    if not isinstance(schema, dict):
        return schema  # true, false: nothing to close
    parts: set[str] = set()
    _collect_parts(schema, parts)
    return _close(schema, True, parts)


def _spread(node: dict) -> bool:
    """Whether the object this schema describes is made of several parts."""
    own = int(isinstance(node.get("properties"), dict)) + int("$ref" in node)
    all_of = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    alternatives = any(isinstance(node.get(k), list) and node[k] for k in ("anyOf", "oneOf"))
    return own + len(all_of) > 1 or (own > 0 and alternatives)


def _members(node: dict) -> list:
    return [m for key in COMPOSITIONS if isinstance(node.get(key), list) for m in node[key]]


def _collect_parts(node: Any, parts: set[str]) -> None:
    """The ``$ref`` strings of definitions used as one part of a spread object."""
    if not isinstance(node, dict):
        return
    if _spread(node):
        refs = [node.get("$ref")] + [m.get("$ref") for m in _members(node) if isinstance(m, dict)]
        parts.update(r for r in refs if isinstance(r, str))
    for sub in _subschemas(node):
        _collect_parts(sub, parts)


def _subschemas(node: dict):
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from node[key]
    for key in SCHEMA_VALUES:
        value = node.get(key)
        if isinstance(value, dict):
            yield value
        elif key == "items" and isinstance(value, list):  # the older drafts' tuple form
            yield from value


def _close(node: Any, close_top: bool, parts: set[str]) -> Any:
    if not isinstance(node, dict):
        return node
    spread = _spread(node)
    out = dict(node)
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            if key in ("$defs", "definitions"):
                prefix = f"#/{key}/"
                out[key] = {name: _close(sub, prefix + name not in parts, parts) for name, sub in node[key].items()}
            else:
                out[key] = {name: _close(sub, True, parts) for name, sub in node[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            member_top = not (spread and key in COMPOSITIONS)
            out[key] = [_close(sub, member_top, parts) for sub in node[key]]
    for key in SCHEMA_VALUES:
        value = node.get(key)
        if isinstance(value, dict):
            out[key] = _close(value, True, parts)
        elif key == "items" and isinstance(value, list):
            out[key] = [_close(sub, True, parts) for sub in value]
    if (close_top and not spread and isinstance(node.get("properties"), dict)
            and not any(k in node for k in OPEN_KEYWORDS)):
        out["additionalProperties"] = False
    return out
