"""Validation and tokenization off the event loop, where large prompts cannot hold small ones back.

Two lanes, each one thread with its own copy of the tokenizer (a tokenizer is not
shared across threads): prompts of up to ``SMALL_PROMPT_CHARS`` characters go to
one, larger ones to the other, so a 2-token request never waits behind a
megabyte of text. Before either, a prompt whose characters alone exceed what
``--max-input-len`` tokens can spell (the vocabulary's longest token times the
limit) is refused at once, without tokenizing it.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

from tandem.cluster.lora_registry import LoraRecord
from tandem.cluster.settings import Settings
from tandem.gateway.errors import InvalidRequest
from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.protocol import CompletionRequest
from tandem.gateway.tokenize_protocol import (DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest,
                                              TokenizeRequest)
from tandem.gateway.validation import GenerationInput, Validator

SMALL_PROMPT_CHARS = 16384


def longest_token_chars(tokenizer) -> int:
    """The most characters one token spells: no text of C characters takes fewer than
    C / this many tokens (byte-level vocabularies spell a byte per character of a token's
    string; sentencepiece ones a character or a byte-fallback token of six)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a readable vocabulary: no bound, tokenizing decides
        return 0
    return max((len(piece) for piece in vocab), default=0)


def prompt_chars(body: CompletionRequest | ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """The characters of each prompt of the request (a chat's messages are one prompt; token ids
    count none: the validator counts them as tokens)."""
    if isinstance(body, (ChatCompletionRequest, TokenizeChatRequest)):
        return [sum(len(m.text) for m in body.messages)]
    if isinstance(body, TokenizeCompletionRequest):
        return [len(body.prompt)]
    return [len(prompt) if isinstance(prompt, str) else 0 for prompt in body.prompts]


class TokenizeLanes:
    def __init__(self, settings: Settings, tokenizer):
        self.max_chars = settings.max_input_len * longest_token_chars(tokenizer)
        small = Validator(settings, tokenizer)
        self._small = (ThreadPoolExecutor(1, thread_name_prefix="tokenize-small"), small)
        # one grammar checker for both lanes: its tokenizer copy is built once, on first use
        self._large = (ThreadPoolExecutor(1, thread_name_prefix="tokenize-large"),
                       Validator(settings, copy.deepcopy(tokenizer), small.grammars))

    async def completion(self, body: CompletionRequest, adapter: LoraRecord | None = None) -> list[GenerationInput]:
        """One input per prompt (``Validator.completion``)."""
        pool, validator = self._lane(body, "prompt")
        return await asyncio.get_running_loop().run_in_executor(pool, validator.completion, body, adapter)

    async def chat(self, body: ChatCompletionRequest, adapter: LoraRecord | None = None) -> GenerationInput:
        pool, validator = self._lane(body, "messages")
        return await asyncio.get_running_loop().run_in_executor(pool, validator.chat, body, adapter)

    async def tokenize(self, body: TokenizeRequest, adapter: LoraRecord | None = None) -> list[int]:
        pool, validator = self._lane(body, None)
        return await asyncio.get_running_loop().run_in_executor(pool, validator.tokenize, body, adapter)

    async def detokenize(self, body: DetokenizeRequest, adapter: LoraRecord | None = None) -> str:
        pool, validator = self._small if len(body.tokens) <= SMALL_PROMPT_CHARS else self._large
        return await asyncio.get_running_loop().run_in_executor(pool, validator.detokenize, body, adapter)

    def _lane(self, body, param: str | None):
        """The lane of the body's text; ``param``: the field refused when no tokenization of a prompt
        could fit the maximum input length (None: no such bound, /tokenize counts any text)."""
        chars = prompt_chars(body)
        if param is not None and self.max_chars and max(chars) > self.max_chars:
            raise InvalidRequest(f"{param} has {max(chars)} characters, more than {self.max_chars}: no tokenization "
                                 f"of it fits the maximum input length", param=param, code="context_length_exceeded")
        return self._small if sum(chars) <= SMALL_PROMPT_CHARS else self._large  # a batch by its whole text

    def shutdown(self) -> None:
        for pool, _ in (self._small, self._large):
            pool.shutdown(wait=False)
