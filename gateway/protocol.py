"""OpenAI request bodies, validated strictly (a wrong type is a 400, never coerced).

Only the shape and per-field ranges are checked here; what needs the tokenizer
or the length limits (prompt length, vocabulary, max_tokens against
max_seq_len) is checked in ``tandem.gateway.validation``. Unknown fields are ignored
like OpenAI does; fields we cannot honour (best_of > 1, echo, tools and
function calls, a JSON response format, tool calls in the messages) are
accepted only at their neutral value, so a request that relies on them gets
a 400 instead of an answer that silently ignored them. As in OpenAI and vLLM,
/v1/completions generates 16 tokens when max_tokens is not given; chat (and an
explicit null) generates up to the end of the context.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tandem.cluster.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what msgpack carries to the workers
MAX_CHOICES = 64  # n: each choice is a sequence of its own on a decode worker


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    # tandem's: the request outlives its connection and its events are kept, for GET /v1/streams/<id>
    resumable: bool | None = False


class SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    best_of: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    user: str | None = None
    return_token_ids: bool | None = False
    skip_special_tokens: bool = True  # vLLM's: drop special tokens from the text
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    min_tokens: int = 0

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not value >= 0.0:  # also rejects NaN
            raise ValueError(f"must be >= 0, got {value}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and not -1 <= value <= INT64_MAX:
            raise ValueError(f"must be -1 or 0 (off) or a positive integer, got {value}")
        return value

    @field_validator("seed", "priority")
    @classmethod
    def _int64(cls, value: int | None) -> int | None:
        if value is not None and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError("must fit in a signed 64-bit integer")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"must be between 1 and {MAX_CHOICES}, got {value}")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {value}")
        if value is not None and value < (info.data.get("n") or 1):
            raise ValueError(f"best_of must not be less than n ({info.data.get('n')}), got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0.0):
            raise ValueError("penalties are not supported: only 0 is accepted")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, value: int) -> int:
        if not 0 <= value <= INT64_MAX:
            raise ValueError(f"must be 0 or more, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream: true")
        return self

    @model_validator(mode="after")
    def _resumable_has_one_choice(self) -> "SamplingFields":
        # a resumable stream's events carry one sequence of ids and its takeover continues one
        # sequence of tokens; n choices would need n of each
        if self.resumable and (self.n or 1) != 1:
            raise ValueError(f"stream_options.resumable needs n = 1 (one choice per resumable stream), got n = {self.n}")
        return self

    @property
    def resumable(self) -> bool:
        """tandem's ``stream_options.resumable``: the stream can be resumed from its events' ids."""
        return bool(self.stream_options and self.stream_options.resumable)

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage so far in every chunk (with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        """How many top logprobs per token (0: the sampled token's only); None: no logprobs."""
        return self.logprobs

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list) -> str | list:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)) and len(value) != 1:
            raise ValueError(f"only one prompt per request is supported, got {len(value)}")
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calls are not supported (no function calling)")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)  # as vLLM joins text parts
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        """How many top logprobs per token (0: the sampled token's only); None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tools and functions (function calling) are not supported")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: str | dict | None) -> str | dict | None:
        if value not in (None, "none", "auto"):
            raise ValueError("only 'none' or 'auto' is supported (no function calling)")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict | None) -> dict | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(f"only the 'text' response format is supported, got {value.get('type')!r}")
        return value

    @model_validator(mode="after")
    def _one_max(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:  # the newer name wins, as in OpenAI and vLLM
            self.max_tokens = self.max_completion_tokens
        return self
