"""OpenAI response bodies and Server-Sent Events, for both endpoints.

A ``ResponseFormat`` knows one endpoint's shapes (``text_completion`` or
``chat.completion``); ``sse_events`` turns a generation's deltas into the
event stream: content chunks (the last one carrying ``finish_reason``), an
optional usage chunk with empty ``choices``, then ``data: [DONE]``. An error
after the stream started becomes ``data: {"error": ...}`` before ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tandem.gateway.errors import error_payload

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None  # one engine.logprobs entry per token id, when the request asked


@dataclass
class ChoiceResult:
    """A finished choice of a non-streamed response."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None  # one engine.logprobs entry per token id, when the request asked


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
    token_text: Callable[[int], str] | None = None  # a token id's text, for logprobs

    def _envelope(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, choices: list[ChoiceResult], usage: Usage) -> dict:
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = []
        for index, result in enumerate(choices):
            logprobs = self.logprobs(result.token_ids, result.logprobs, 0)
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": result.text},
                          "logprobs": logprobs, "finish_reason": result.finish_reason}
            else:
                choice = {"index": index, "text": result.text, "logprobs": logprobs,
                          "finish_reason": result.finish_reason}
            self._add_token_ids(body, choice, result.token_ids, with_prompt=True)
            body["choices"].append(choice)
        body["usage"] = usage.to_dict()
        return body

    def chunk(self, delta: Delta, first: bool, index: int = 0, text_offset: int = 0) -> dict:
        """One streamed delta of choice ``index``; ``first`` (that choice's first) adds
        prompt_token_ids (completions only: chat has role_chunk); ``text_offset``: where the
        delta's tokens start in the choice's text (completions' logprobs)."""
        logprobs = self.logprobs(delta.token_ids, delta.logprobs, text_offset)
        if self.chat:
            body = self._envelope("chat.completion.chunk")
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        else:
            body = self._envelope("text_completion")
            choice = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        self._add_token_ids(body, choice, delta.token_ids, with_prompt=first)
        body["choices"] = [choice]
        return body

    def logprobs(self, token_ids: list[int], entries: list | None, text_offset: int) -> dict | None:
        """OpenAI's logprobs object of some tokens (None when the request did not ask): for chat
        ``{"content": [{token, logprob, bytes, top_logprobs}]}``; for completions ``{tokens,
        token_logprobs, top_logprobs (the top k and the sampled token), text_offset}``."""
        if entries is None:
            return None
        texts = [self.token_text(t) for t in token_ids]
        if self.chat:
            def item(text: str, logprob: float | None) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [
                {**item(text, entry and entry[0]),
                 "top_logprobs": [item(self.token_text(i), lp) for i, lp in (entry[1] if entry else [])]}
                for text, entry in zip(texts, entries)]}
        offsets, top = [], []
        for text, entry in zip(texts, entries):
            offsets.append(text_offset)
            text_offset += len(text)
            if entry is None:
                top.append(None)
                continue
            best = {self.token_text(i): lp for i, lp in entry[1]}
            best.setdefault(text, entry[0])
            top.append(best)
        return {"tokens": texts, "token_logprobs": [e and e[0] for e in entries], "top_logprobs": top,
                "text_offset": offsets}

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
    finished: set[int] = set()  # choices whose last chunk went out
    offsets: dict[int, int] = {}  # per choice: where its next token's text starts (completions' logprobs)
    try:
        if fmt.chat:
            for index in range(num_choices):
                yield sse(fmt.role_chunk(index))
        async for index, delta in deltas:
            if not delta.text and delta.finish_reason is None and not fmt.return_token_ids and not delta.logprobs:
                continue  # held-back text (partial character, possible stop string): nothing to send yet
            offset = offsets.get(index, 0)
            chunk = fmt.chunk(delta, first=index not in started and not fmt.chat, index=index, text_offset=offset)
            logprobs = chunk["choices"][0]["logprobs"]
            if logprobs and "tokens" in logprobs:  # completions: the next token's text starts after these
                offsets[index] = offset + sum(map(len, logprobs["tokens"]))
            if continuous_usage:
                chunk["usage"] = usage().to_dict()
            yield sse(chunk)
            started.add(index)
            if delta.finish_reason is not None:
                finished.add(index)
        if include_usage:
            yield sse(fmt.usage_chunk(usage()))
    except Exception as exc:  # after the 200 went out, an error can only travel in the stream
        for index in range(num_choices):  # every choice not yet ended ends here
            if index not in finished:
                yield sse(fmt.chunk(Delta("", [], "error"), first=False, index=index))
        yield sse(error_payload(exc)[1])
    yield DONE
