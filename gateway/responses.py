"""OpenAI response bodies and Server-Sent Events, for both endpoints.

A ``ResponseFormat`` knows one endpoint's shapes (``text_completion`` or
``chat.completion``); ``sse_events`` turns a generation's deltas into the
event stream: content chunks (the last one carrying ``finish_reason``), an
optional usage chunk with empty ``choices``, then ``data: [DONE]``. An error
after the stream started becomes ``data: {"error": ...}`` before ``[DONE]``.

Every event the gateway sends carries an id, ``<request_id>.<seq>`` with seq
counting the stream's events from 0 (``[DONE]`` included): ``with_ids`` adds
them. ``sse_events`` keeps what its next events depend on in a
``StreamPosition``, so a stream another gateway continues (a resumable one,
``tandem.gateway.resume``) goes on from its last retained event's position.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tandem.gateway.errors import error_payload

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def event_id(request_id: str, seq: int) -> str:
    return f"{request_id}.{seq}"


_SEQ = re.compile(r"[0-9]{1,18}")


def parse_event_id(request_id: str, value: str) -> int | None:
    """The seq of an event id of ``request_id``'s stream; None when ``value`` is not one."""
    prefix, dot, seq = value.rpartition(".")
    if not dot or prefix != request_id or not _SEQ.fullmatch(seq):
        return None
    return int(seq)


def with_id(frame: bytes, request_id: str, seq: int) -> bytes:
    """``frame`` (one ``data:`` event) with its ``id:`` line. The id goes after the data (SSE fields
    may come in any order): clients that read an event's first line as its data keep working."""
    return frame[:-1] + b"id: " + event_id(request_id, seq).encode() + b"\n\n"


async def with_ids(request_id: str, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Number a stream's events from 0."""
    seq = 0
    async for frame in frames:
        yield with_id(frame, request_id, seq)
        seq += 1


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None  # one engine.logprobs entry per token id, when the request asked
    # a choice's first delta: what leads it, when asked (``PromptPart``)
    prompt: "PromptPart | None" = None
    tool_calls: list | None = None  # chat: calls complete with this delta (OpenAI's shape, with index)


@dataclass
class PromptPart:
    """What a choice carries of its prompt: ``echo`` (completions' echo: the prompt's text, which
    the choice's text starts with) and ``logprobs`` (one engine.prompt_logprobs entry per prompt
    token, the first None; None when not asked)."""

    echo: str | None = None
    logprobs: list | None = None


@dataclass
class ChoiceResult:
    """A finished choice of a non-streamed response."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None  # one engine.logprobs entry per token id, when the request asked
    prompt: PromptPart | None = None
    tool_calls: list | None = None  # chat: the calls read out of the output (OpenAI's shape)


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
class StreamPosition:
    """What an event stream has sent, as far as its next events depend on it (JSON-able, so a
    resumable stream keeps it with each event and another gateway can go on from there)."""

    roles_sent: int = 0  # chat: choices whose role chunk went out
    started: set[int] = field(default_factory=set)  # choices that sent a chunk
    finished: set[int] = field(default_factory=set)  # choices whose last chunk went out
    offsets: dict[int, int] = field(default_factory=dict)  # per choice: where its next token's text starts
    usage_sent: bool = False
    failed: bool = False  # the stream's error events started

    def to_dict(self) -> dict:
        return {"roles": self.roles_sent, "started": sorted(self.started), "finished": sorted(self.finished),
                "offsets": {str(i): o for i, o in self.offsets.items()}, "usage": self.usage_sent,
                "failed": self.failed}

    @classmethod
    def from_dict(cls, d: dict) -> "StreamPosition":
        return cls(d["roles"], set(d["started"]), set(d["finished"]),
                   {int(i): o for i, o in d["offsets"].items()}, d["usage"], d["failed"])


@dataclass
class ResponseFormat:
    """The shapes of one response: ``chat`` picks chat.completion over text_completion."""

    request_id: str
    created: int
    model: str
    chat: bool
    return_token_ids: bool = False
    prompts: list[list[int]] | None = None  # each prompt's token ids (a batch of completions has several)
    token_text: Callable[[int], str] | None = None  # a token id's text, for logprobs
    choices_per_prompt: int = 1  # choice i answers prompt i // choices_per_prompt

    def prompt_token_ids(self, index: int = 0) -> list[int] | None:
        """The token ids of the prompt choice ``index`` answers."""
        return None if self.prompts is None else self.prompts[index // self.choices_per_prompt]

    def _envelope(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, choices: list[ChoiceResult], usage: Usage) -> dict:
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body["choices"] = []
        for index, result in enumerate(choices):
            text, logprobs = self._with_prompt(result.prompt, result.text, result.token_ids, result.logprobs, 0, index)
            if self.chat:
                message = {"role": "assistant", "content": result.text}
                if result.tool_calls:
                    message = {"role": "assistant", "content": result.text or None, "tool_calls": result.tool_calls}
                choice = {"index": index, "message": message, "logprobs": logprobs,
                          "finish_reason": result.finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": result.finish_reason}
            self._add_token_ids(body, choice, result.token_ids, with_prompt=True, index=index)
            self._add_prompt_logprobs(body, choice, result.prompt, index)
            body["choices"].append(choice)
        body["usage"] = usage.to_dict()
        return body

    def chunk(self, delta: Delta, first: bool, index: int = 0, text_offset: int = 0) -> dict:
        """One streamed delta of choice ``index``; ``first`` (that choice's first) adds
        prompt_token_ids (completions only: chat has role_chunk); ``text_offset``: where the
        delta's tokens start in the choice's text (completions' logprobs)."""
        text, logprobs = self._with_prompt(delta.prompt, delta.text, delta.token_ids, delta.logprobs, text_offset,
                                           index)
        if self.chat:
            body = self._envelope("chat.completion.chunk")
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            if delta.tool_calls:
                content = {**({"content": delta.text} if delta.text else {}), "tool_calls": delta.tool_calls}
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        else:
            body = self._envelope("text_completion")
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        self._add_token_ids(body, choice, delta.token_ids, with_prompt=first, index=index)
        self._add_prompt_logprobs(body, choice, delta.prompt, index)
        body["choices"] = [choice]
        return body

    def _with_prompt(self, prompt: PromptPart | None, text: str, token_ids: list[int], entries: list | None,
                     text_offset: int, index: int) -> tuple[str, dict | None]:
        """A choice's (or its first chunk's) text and logprobs object, led by the prompt when it is
        echoed (completions, as OpenAI's legacy API and vLLM: the prompt's text, and its tokens'
        logprobs before the output's, the first token's null)."""
        if self.chat or prompt is None or prompt.echo is None:
            return text, self.logprobs(token_ids, entries, text_offset)
        prompt_ids = list(self.prompt_token_ids(index) or [])
        if entries is not None:
            prompt_entries = prompt.logprobs if prompt.logprobs is not None else [None] * len(prompt_ids)
            token_ids, entries = prompt_ids + list(token_ids), list(prompt_entries) + list(entries)
        return prompt.echo + text, self.logprobs(token_ids, entries, text_offset)

    def prompt_logprobs(self, entries: list, index: int = 0) -> list:
        """vLLM's ``prompt_logprobs`` of choice ``index``'s prompt: per prompt token None (the first)
        or ``{"<token id>": {logprob, rank, decoded_token}}`` for the prompt's token and the k most likely."""
        def item(token_id: int, logprob: float, rank: int) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token_id)}

        out: list[dict | None] = []
        for token_id, entry in zip(self.prompt_token_ids(index) or [], entries):
            if entry is None:
                out.append(None)
                continue
            logprob, top, rank = entry
            ranked = {str(token_id): item(token_id, logprob, rank)}
            for top_rank, (top_id, top_logprob) in enumerate(top, 1):
                ranked.setdefault(str(top_id), item(top_id, top_logprob, top_rank))
            out.append(ranked)
        return out

    def _add_prompt_logprobs(self, body: dict, choice: dict, prompt: PromptPart | None, index: int) -> None:
        # where vLLM puts them: on the choice for completions, at the top level for chat
        if prompt is not None and prompt.logprobs is not None:
            (body if self.chat else choice).setdefault("prompt_logprobs", self.prompt_logprobs(prompt.logprobs, index))

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
            body["prompt_token_ids"] = self.prompt_token_ids()
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.to_dict()
        return body

    def _add_token_ids(self, body: dict, choice: dict, token_ids: list[int], with_prompt: bool, index: int) -> None:
        # where vLLM puts them: token_ids on the choice; prompt_token_ids on the choice for
        # completions, at the top level for chat
        if not self.return_token_ids:
            return
        choice["token_ids"] = list(token_ids)
        if with_prompt:
            (body if self.chat else choice)["prompt_token_ids"] = self.prompt_token_ids(index)


async def sse_events(fmt: ResponseFormat, deltas: AsyncIterator[tuple[int, Delta]], usage, include_usage: bool,
                     continuous_usage: bool = False, num_choices: int = 1, position: StreamPosition | None = None):
    """The event stream of one request: ``deltas`` yields (choice index, delta). ``usage()`` is
    read after the last delta (and, with ``continuous_usage``, for every chunk: the usage so far,
    as vLLM's continuous_usage_stats). ``position`` (updated before each event is yielded): where a
    stream continued from retained events stands; the events it says were sent are not sent again."""
    at = position if position is not None else StreamPosition()
    try:
        if fmt.chat:
            while at.roles_sent < num_choices:
                at.roles_sent += 1
                yield sse(fmt.role_chunk(at.roles_sent - 1))
        async for index, delta in deltas:
            if (not delta.text and delta.finish_reason is None and not fmt.return_token_ids and not delta.logprobs
                    and delta.prompt is None and not delta.tool_calls):
                continue  # held-back text (partial character, possible stop string): nothing to send yet
            offset = at.offsets.get(index, 0)
            chunk = fmt.chunk(delta, first=index not in at.started and not fmt.chat, index=index, text_offset=offset)
            logprobs = chunk["choices"][0]["logprobs"]
            if logprobs and "tokens" in logprobs:  # completions: the next token's text starts after these
                at.offsets[index] = offset + sum(map(len, logprobs["tokens"]))
            if continuous_usage:
                chunk["usage"] = usage().to_dict()
            at.started.add(index)
            if delta.finish_reason is not None:
                at.finished.add(index)
            yield sse(chunk)
        if include_usage and not at.usage_sent and not at.failed:
            at.usage_sent = True
            yield sse(fmt.usage_chunk(usage()))
    except Exception as exc:  # after the 200 went out, an error can only travel in the stream
        at.failed = True
        for index in range(num_choices):  # every choice not yet ended ends here
            if index not in at.finished:
                at.finished.add(index)
                yield sse(fmt.chunk(Delta("", [], "error"), first=False, index=index))
        yield sse(error_payload(exc)[1])
    yield DONE
