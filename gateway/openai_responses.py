"""OpenAI's Responses API (POST /v1/responses) for text: a request becomes the chat completion it
describes (``instructions`` a system message, ``input`` the messages, ``text.format`` the
structured output), served by the same validation, admission, failover and sampling, and its
answer the ``response`` object, or, streamed, the API's typed events (``response.created``,
``response.output_text.delta`` ... ``response.completed``), each numbered by ``sequence_number``.

What a text server cannot honour is refused at its non-neutral value (a 400 naming the field):
stored responses (``store: true``, ``previous_response_id``: nothing is kept), tools, and
inputs that are not text messages. An answer cut by ``max_output_tokens`` is ``incomplete``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, field_validator

from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.errors import InvalidRequest, error_payload
from tandem.gateway.protocol import StrictModel
from tandem.gateway.responses import Delta, Usage, sse

# a chat field's error, named as this API names the field
_FIELDS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as chat joins text parts


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = True
    tool_choice: Literal["auto", "none"] | None = None
    # neutral values only: nothing is stored, no tools run here
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, value: str | list[InputMessage]) -> str | list[InputMessage]:
        if not value:
            raise ValueError("input must not be empty")
        return value

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("responses are not stored here: send store false (or leave it out)")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _previous(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("responses are not stored here: send the conversation so far as input")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tools are not served on /v1/responses: use /v1/chat/completions")
        return value

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion this request describes (validated as one: its errors are a chat's)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [{"role": m.role, "content": m.text} for m in self.input]
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_ if fmt.schema_ is not None else {}, "strict": fmt.strict}}
        return ChatCompletionRequest.model_validate(chat)


def as_responses_error(exc: InvalidRequest) -> InvalidRequest:
    """A chat completion's 400 about a field, naming the field as this request names it."""
    param = _FIELDS.get(exc.param or "")
    if param is None:
        return exc
    return InvalidRequest(exc.message.replace(exc.param, param), param=param, code=exc.code)


class ResponseShape:
    """The response object of one request, and its streamed events."""

    def __init__(self, body: ResponsesRequest, request_id: str, model: str, created_at: int):
        self.body = body
        self.id = request_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = created_at

    def response(self, status: str, text: str | None, usage: Usage | None, finish_reason: str | None = None) -> dict:
        """The ``response`` object: ``text`` None while in progress (no output yet)."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": [] if text is None else [self.message(text, "completed" if status == "completed" else "incomplete")],
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls, "tool_choice": body.tool_choice or "auto",
            "tools": [], "text": {"format": {"type": "text"}} if body.text is None else body.text.model_dump(
                by_alias=True, exclude_none=True),
            "store": False, "previous_response_id": None, "user": body.user, "error": None,
            "incomplete_details": incomplete, "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def message(self, text: str | None, status: str) -> dict:
        """The answer's one output item (``text`` None: no content part yet)."""
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if text is None else [self.part(text)]}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    def complete(self, text: str, finish_reason: str | None, usage: Usage) -> dict:
        status = "incomplete" if finish_reason == "length" else "completed"
        return self.response(status, text, usage, finish_reason)

    async def events(self, deltas: AsyncIterator[tuple[int, Delta]], usage) -> AsyncIterator[bytes]:
        """The typed event stream of one answer (``usage()`` read at its end); an error after the
        stream started is an ``error`` event, then ``response.failed``."""
        seq = 0

        def event(kind: str, **fields) -> bytes:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return b"event: " + kind.encode() + b"\n" + sse(payload)

        item = {"output_index": 0, "item_id": self.message_id}
        yield event("response.created", response=self.response("in_progress", None, None))
        yield event("response.in_progress", response=self.response("in_progress", None, None))
        yield event("response.output_item.added", output_index=0, item=self.message(None, "in_progress"))
        yield event("response.content_part.added", **item, content_index=0, part=self.part(""))
        text, finish_reason = "", None
        try:
            async for _index, delta in deltas:
                if delta.text:
                    text += delta.text
                    yield event("response.output_text.delta", **item, content_index=0, delta=delta.text, logprobs=[])
                finish_reason = delta.finish_reason or finish_reason
        except Exception as exc:  # after the 200 went out, an error can only travel in the stream
            _status, body, _headers = error_payload(exc)
            error = body["error"]
            yield event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
            failed = self.response("failed", text, None)
            failed["error"] = {"code": error.get("code") or "server_error", "message": error["message"]}
            yield event("response.failed", response=failed)
            return
        yield event("response.output_text.done", **item, content_index=0, text=text, logprobs=[])
        yield event("response.content_part.done", **item, content_index=0, part=self.part(text))
        final = self.complete(text, finish_reason, usage())
        yield event("response.output_item.done", output_index=0, item=final["output"][0])
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                    response=final)

