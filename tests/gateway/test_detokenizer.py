"""Incremental detokenization: same text as a full decode, no partial characters."""

from __future__ import annotations

import pytest

from tandem.gateway.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces and\nnew lines\n\n",
    "héllo wörld, naïve café",
    "snowman ☃ robot 🤖 and 日本語のテキスト",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Once upon a time", "多字节 prompt ✓"])
def test_token_by_token_matches_full_decode(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else [1]
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.add([token_id]) for token_id in output_ids]
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in piece for piece in pieces)


def test_multibyte_character_is_held_until_complete(tokenizer):
    output_ids = tokenizer.encode("🤖", add_special_tokens=False)
    assert len(output_ids) > 1, "the tiny tokenizer splits an emoji into byte tokens"
    detok = IncrementalDetokenizer(tokenizer, [1])
    pieces = [detok.add([t]) for t in output_ids]
    assert pieces[:-1] == [""] * (len(output_ids) - 1)
    assert pieces[-1] == "🤖"


def test_batches_of_tokens_and_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("Paris is the capital of France", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1, 5, 6])
    out = detok.add(ids[:3]) + detok.add([tokenizer.bos_token_id]) + detok.add(ids[3:]) + detok.add([2])
    assert out == "Paris is the capital of France"


def test_special_tokens_kept_when_asked(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    assert "".join(detok.add([t]) for t in ids) == "hi</s>"


def test_flush_releases_an_incomplete_character_at_the_end(tokenizer):
    robot = tokenizer.encode("🤖", add_special_tokens=False)
    ids = tokenizer.encode("ok ", add_special_tokens=False) + robot[:-1]
    detok = IncrementalDetokenizer(tokenizer, [1])
    streamed = "".join(detok.add([t]) for t in ids)
    assert streamed == "ok "
    tail = detok.flush()
    assert streamed + tail == tokenizer.decode(ids) == detok.text
    assert tail.endswith("\ufffd")
    assert detok.flush() == ""


def test_invalid_bytes_in_the_middle_come_out_like_decode(tokenizer):
    robot = tokenizer.encode("🤖", add_special_tokens=False)
    ids = robot[:1] + tokenizer.encode("abc", add_special_tokens=False) + robot[1:2]
    detok = IncrementalDetokenizer(tokenizer, [1])
    out = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert out == tokenizer.decode(ids)
