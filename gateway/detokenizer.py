"""Incremental detokenization with prefix/read offsets (the vLLM algorithm).

Decoding tokens one at a time is wrong for two reasons: SentencePiece and
byte-level tokenizers decide spaces and multi-byte characters from context,
and a token can end in the middle of a UTF-8 character. So each step decodes
a short window ``tokens[prefix_offset:]`` and emits only what it adds beyond
``tokens[prefix_offset:read_offset]``; text ending in U+FFFD (an incomplete
character) is held back until the next token completes it. The window starts
inside the prompt, so the first output token is decoded in context too.
When the request ends, ``flush`` releases whatever is still held back.
"""

from __future__ import annotations

import weakref

_SPECIAL_IDS: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids ``skip_special_tokens`` drops, computed once per tokenizer: ``all_special_ids``
    and every added token marked special (Llama 3's header and end-of-turn tokens are not in the
    special-tokens map; HF decode and vLLM drop them too)."""
    ids = _SPECIAL_IDS.get(tokenizer)
    if ids is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        ids = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
        _SPECIAL_IDS[tokenizer] = ids
    return ids


# how many prompt tokens the first window includes (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
INITIAL_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        # filtered here: asking the tokenizer to skip rebuilds its special-token list on every call
        self._skipped_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        context = prompt_token_ids[-(INITIAL_OFFSET + 1):]
        self._tokens: list[str] = self._to_tokens(context)
        self._prefix_offset = max(len(self._tokens) - INITIAL_OFFSET, 0)
        self._read_offset = len(self._tokens)
        self.text = ""  # everything emitted so far

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; return the text they complete (may be "")."""
        new_text = "".join(self._add_one(token_id) for token_id in token_ids)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """The request ended: release held-back text, even an incomplete character (as U+FFFD).

        The whole output then reads exactly like ``tokenizer.decode(output_ids)``.
        """
        prefix_text = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        window_text = self._to_string(self._tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._tokens)
        new_text = window_text[len(prefix_text) :] if len(window_text) > len(prefix_text) else ""
        self.text += new_text
        return new_text

    def _add_one(self, token_id: int) -> str:
        self._tokens.extend(self._to_tokens([token_id]))
        prefix_text = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        window_text = self._to_string(self._tokens[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or an incomplete character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return window_text[len(prefix_text) :]

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        kept = [t for t in token_ids if t not in self._skipped_ids]
        tokens = self._tokenizer.convert_ids_to_tokens(kept) if kept else []
        return [t for t in tokens if t is not None]

    def _to_string(self, tokens: list[str]) -> str:
        return self._tokenizer.convert_tokens_to_string(tokens) if tokens else ""
