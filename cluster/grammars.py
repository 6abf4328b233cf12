"""Structured outputs as grammars for llguidance, made and checked where the request arrives.

Every way a request can constrain its output (``response_format`` json_object or
json_schema, vLLM's ``structured_outputs`` json / regex / choice / grammar, forced
tool calls) becomes one llguidance grammar string (``SamplingParams.grammar``).
The gateway checks it against the model's tokenizer before any worker sees the
request, so a schema or grammar the engine refuses is a 400 with the engine's
own message; the worker that samples a token builds a matcher from the same
string (``tandem.engine.guide``).

JSON is compact unless the request gives a ``whitespace_pattern``: no whitespace
between tokens at all, so a weak model cannot spin in whitespace until
``max_tokens`` (llguidance's ``whitespace_flexible`` off). For the same reason an
object schema admits only its declared properties unless it says otherwise
(``tandem.cluster.strict_schemas``); ``closed=False`` keeps JSON Schema's own
reading (any other key allowed).

Why llguidance (docs/architecture.md, "Structured outputs", measured with
``tandem bench grammar``): it has no torch dependency, so the torch-free gateway
checks grammars with the very engine the workers mask with; a new request costs
0.2-0.7 ms before its first mask (xgrammar compiles each schema: 1-7 ms, uncached),
which is time on the first token's path; its masks take 10-20 us a row (xgrammar's
3-14 us), well inside the forward they overlap.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.cluster.strict_schemas import close_objects

LLGUIDANCE_WHITESPACE = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A structured output the grammar engine refuses (its message, for the client)."""


def json_schema_grammar(schema: dict[str, Any] | bool, whitespace_pattern: str | None = None,
                        closed: bool = True) -> str:
    """``closed``: object schemas without ``additionalProperties`` admit their declared keys only."""
    from llguidance import LLMatcher

    options: dict[str, Any] = dict(LLGUIDANCE_WHITESPACE)
    if whitespace_pattern is not None:
        options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    if schema is True:
        schema = {}
    if closed:
        schema = close_objects(schema)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc


def regex_grammar(regex: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(regex)


def lark_grammar(lark: str) -> str:
    """Lark (llguidance's dialect) or GBNF (llama.cpp's, told by its ``::=`` rules)."""
    from llguidance import LLMatcher, gbnf_to_lark

    if "::=" in lark:
        try:
            lark = gbnf_to_lark.gbnf_to_lark(lark)
        except Exception as exc:  # the converter raises its parser's own errors
            raise GrammarError(f"invalid GBNF grammar: {exc}") from exc
    return LLMatcher.grammar_from_lark(lark)


def lark_string(text: str) -> str:
    """A Lark string literal matching ``text`` exactly (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    return lark_grammar("start: " + " | ".join(lark_string(c) for c in choices))


class Grammars:
    """Checks grammars against one tokenizer (an HF fast tokenizer); its llguidance copy is
    built on first use (about a second for a large vocabulary) and shared by the callers."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size)
        return self._ll_tokenizer

    def check(self, grammar: str) -> str:
        """``grammar`` when the engine accepts it for this tokenizer; GrammarError otherwise."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise GrammarError(error.strip())
        return grammar


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for an HF fast tokenizer; its rows of the mask cover ``vocab_size``
    (the model's logits may be wider than the tokenizer's vocabulary: padding rows, never allowed)."""
    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise GrammarError("structured outputs need a fast (tokenizers-backed) tokenizer")
    import copy

    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
