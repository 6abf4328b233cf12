"""OpenAI response bodies and Server-Sent Events, for both endpoints.

A ``ResponseFormat`` knows one endpoint's shapes (``text_completion`` or
``chat.completion``); ``sse_events`` turns a generation's deltas into the
event stream: content chunks (the last one carrying ``finish_reason``), an
optional usage chunk with empty ``choices``, then ``data: [DONE]``. An error
after the stream started becomes ``data: {"error": ...}`` before ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.errors import error_payload

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


@dataclass
class ResponseFormat:
    """The shapes of one response: ``chat`` picks chat.completion over text_completion."""

    request_id: str
    created: int
    model: str
    chat: bool
    return_token_ids: bool = False
    prompt_token_ids: list[int] | None = None

    def _envelope(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, choices: list[tuple[str, list[int], str | None]], usage: Usage) -> dict:
        """``choices``: (text, token ids, finish_reason) per choice, in index order."""
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = []
        for index, (text, token_ids, finish_reason) in enumerate(choices):
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text},
                          "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
            self._add_token_ids(body, choice, token_ids, with_prompt=True)
            body["choices"].append(choice)
        body["usage"] = usage.to_dict()
        return body

    def chunk(self, delta: Delta, first: bool, index: int = 0) -> dict:
        """One streamed delta of choice ``index``; ``first`` (that choice's first) adds
        prompt_token_ids (completions only: chat has role_chunk)."""
        if self.chat:
            body = self._envelope("chat.completion.chunk")
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            choice = {"index": index, "delta": content, "logprobs": None, "finish_reason": delta.finish_reason}
        else:
            body = self._envelope("text_completion")
            choice = {"index": index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        self._add_token_ids(body, choice, delta.token_ids, with_prompt=first)
        body["choices"] = [choice]
        return body

    def role_chunk(self, index: int = 0) -> dict:
        """Chat streams open with the assistant role and no content, one chunk per choice."""
        body = self._envelope("chat.completion.chunk")
        body["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]
        if self.return_token_ids and index == 0:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.to_dict()
        return body

    def _add_token_ids(self, body: dict, choice: dict, token_ids: list[int], with_prompt: bool) -> None:
        # where vLLM puts them: token_ids on the choice; prompt_token_ids on the choice for
        # completions, at the top level for chat
        if not self.return_token_ids:
            return
        choice["token_ids"] = list(token_ids)
        if with_prompt:
            (body if self.chat else choice)["prompt_token_ids"] = self.prompt_token_ids


async def sse_events(fmt: ResponseFormat, deltas: AsyncIterator[tuple[int, Delta]], usage, include_usage: bool,
                     continuous_usage: bool = False, num_choices: int = 1):
    """The event stream of one request: ``deltas`` yields (choice index, delta). ``usage()`` is
    read after the last delta (and, with ``continuous_usage``, for every chunk: the usage so far,
    as vLLM's continuous_usage_stats)."""
    started: set[int] = set()  # choices that sent a chunk
    try:
        if fmt.chat:
            for index in range(num_choices):
                yield sse(fmt.role_chunk(index))
        async for index, delta in deltas:
            if not delta.text and delta.finish_reason is None and not fmt.return_token_ids:
                continue  # held-back text (partial character, possible stop string): nothing to send yet
            chunk = fmt.chunk(delta, first=index not in started and not fmt.chat, index=index)
            if continuous_usage:
                chunk["usage"] = usage().to_dict()
            yield sse(chunk)
            started.add(index)
        if include_usage:
            yield sse(fmt.usage_chunk(usage()))
    except Exception as exc:  # after the 200 went out, an error can only travel in the stream
        yield sse(fmt.chunk(Delta("", [], "error"), first=False))
        yield sse(error_payload(exc)[1])
    yield DONE
