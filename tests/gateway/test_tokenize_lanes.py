"""Large prompts cannot starve small ones, and an impossible one is refused untokenized."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.gateway.errors import InvalidRequest
from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.protocol import CompletionRequest
from tandem.gateway.tokenize_lanes import SMALL_PROMPT_CHARS, TokenizeLanes, longest_token_chars
from tests.gateway.conftest import make_settings


class _SlowOnLargeTokenizer:
    """A tokenizer wrapper whose large encodes take a while (what a megabyte of text costs)."""

    def __init__(self, inner, delay_s: float):
        self._inner, self._delay_s = inner, delay_s

    def encode(self, text, **kwargs):
        if len(text) > SMALL_PROMPT_CHARS:
            time.sleep(self._delay_s)
        return self._inner.encode(text, **kwargs)

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):
        if name.startswith("_"):  # copy.deepcopy asks before _inner exists
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_small_prompt_does_not_wait_behind_large_ones(model_dir, redis_url, tokenizer):
    settings = make_settings(model_dir, redis_url)
    lanes = TokenizeLanes(settings, _SlowOnLargeTokenizer(tokenizer, delay_s=1.0))
    lanes.max_chars = 0  # no character bound here: the large prompts are tokenized (and then refused)
    large = CompletionRequest(model="tiny", prompt="a " * (SMALL_PROMPT_CHARS // 2 + 10), max_tokens=1)
    small = CompletionRequest(model="tiny", prompt="hi", max_tokens=1)

    async def run():
        big = [asyncio.ensure_future(lanes.completion(large)) for _ in range(3)]
        await asyncio.sleep(0.05)  # the large lane is busy now
        started = time.monotonic()
        await lanes.completion(small)
        waited = time.monotonic() - started
        for task in big:
            task.cancel()
        await asyncio.gather(*big, return_exceptions=True)
        return waited

    try:
        assert asyncio.run(run()) < 0.5  # behind three one-second encodes in one lane it would be 3 s
    finally:
        lanes.shutdown()


def test_a_prompt_longer_than_any_tokenization_can_fit_is_refused_untokenized(model_dir, redis_url, tokenizer):
    settings = make_settings(model_dir, redis_url)
    calls = []

    class Counting(_SlowOnLargeTokenizer):
        def encode(self, text, **kwargs):
            calls.append(len(text))
            return super().encode(text, **kwargs)

    lanes = TokenizeLanes(settings, Counting(tokenizer, delay_s=0.0))
    limit = settings.max_input_len * longest_token_chars(tokenizer)
    assert lanes.max_chars == limit > 0
    try:
        for body in (CompletionRequest(model="tiny", prompt="x" * (limit + 1), max_tokens=1),
                     ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x" * (limit + 1)}])):
            with pytest.raises(InvalidRequest, match="characters") as refused:
                asyncio.run(lanes.completion(body) if isinstance(body, CompletionRequest) else lanes.chat(body))
            assert refused.value.code == "context_length_exceeded"
        assert calls == []  # nothing was tokenized
        asyncio.run(lanes.completion(CompletionRequest(model="tiny", prompt="x" * 10, max_tokens=1)))
        assert calls == [10]
    finally:
        lanes.shutdown()
