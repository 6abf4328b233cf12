"""OpenAI request bodies, validated strictly (a wrong type is a 400, never coerced).

Only the shape and per-field ranges are checked here; what needs the tokenizer,
the grammar engine or the length limits (prompt length, vocabulary, a schema
the grammar engine refuses, max_tokens against max_seq_len) is checked in
``tandem.gateway.validation``. Unknown fields are ignored like OpenAI does;
fields we cannot honour (``suffix``, the deprecated ``functions``) are accepted
only at their neutral value, so a request that relies on them gets a 400
instead of an answer that silently ignored them. As in OpenAI and vLLM,
/v1/completions generates 16 tokens when max_tokens is not given; chat (and an
explicit null) generates up to the end of the context.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tandem.cluster.sampling import BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, PENALTY_RANGE

MAX_STOP_STRINGS = 16
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what msgpack carries to the workers
MAX_CHOICES = 64  # n and best_of: each choice is a sequence of its own on a decode worker
MAX_CHOICE_STRINGS = 1024  # structured_outputs.choice
# /v1/completions' prompt as a list of prompts (a batch: each prompt's choices are sequences of their
# own, as n's are): at most MAX_PROMPTS prompts and MAX_BATCH_SEQUENCES sequences in all
MAX_PROMPTS = 1024
MAX_BATCH_SEQUENCES = 4096


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    # tandem's: the request outlives its connection and its events are kept, for GET /v1/streams/<id>
    resumable: bool | None = False


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: the schema is under "schema" (a pydantic name, hence the alias)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs its json_schema")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect), or GBNF
    json_object: bool | None = None
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens (a regex)
    # vLLM's name. True (our default, as xgrammar's and OpenAI's): an object schema without
    # additionalProperties admits its declared properties only; False: any other key too
    disable_additional_properties: bool = True

    @field_validator("choice")
    @classmethod
    def _choice(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not 1 <= len(value) <= MAX_CHOICE_STRINGS:
            raise ValueError(f"must hold between 1 and {MAX_CHOICE_STRINGS} strings, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of json, regex, choice, grammar, json_object must be given, got {given}")
        return self


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class SamplingFields(StrictModel):
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
    repetition_penalty: float | None = None  # vLLM's (HF's rule, over prompt and output)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured_outputs' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
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
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"must be between 1 and {MAX_CHOICES}, got {value}")
        if value is not None and value < (info.data.get("n") or 1):
            raise ValueError(f"best_of must not be less than n ({info.data.get('n')}), got {value}")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value is not None and not -PENALTY_RANGE <= value <= PENALTY_RANGE:  # also rejects NaN
            raise ValueError(f"must be between -{PENALTY_RANGE:g} and {PENALTY_RANGE:g}, got {value}")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: float | None) -> float | None:
        if value is not None and not (value > 0.0 and math.isfinite(value)):
            raise ValueError(f"must be a finite number > 0, got {value}")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"must be in [0, 1], got {value}")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_LOGPROBS}, got {value}")
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
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()) or int(key) > INT64_MAX:
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -BIAS_RANGE <= bias <= BIAS_RANGE:
                raise ValueError(f"biases must be between -{BIAS_RANGE:g} and {BIAS_RANGE:g}, got {bias} for {key}")
        return value

    @model_validator(mode="after")
    def _best_of_not_streamed(self) -> "SamplingFields":
        if (self.best_of or 1) > (self.n or 1) and self.stream:
            raise ValueError("best_of greater than n cannot be streamed (the best are known only at the end)")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self) -> "SamplingFields":
        if len(self.structured_output_fields) > 1:
            raise ValueError(f"at most one structured output may be asked for, got {self.structured_output_fields}")
        return self

    @property
    def structured_output_fields(self) -> list[str]:
        """The fields that ask for structured output (a text response_format does not)."""
        names = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            names.append("response_format")
        return names

    @property
    def structured(self) -> StructuredOutputs | None:
        """The structured output asked for, in vLLM's one shape; None: free text."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputs(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.json_schema
            return StructuredOutputs(json=schema if schema is not None else {})
        if self.structured_outputs is not None:
            return self.structured_outputs
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                return StructuredOutputs(**{key: value})
        return None

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

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        # 0: score the prompt (with echo or prompt_logprobs: tandem.gateway.validation), generate nothing
        if value is not None and value < 0:
            raise ValueError(f"must be at least 0, got {value}")
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
        if isinstance(value, list) and value and isinstance(value[0], (str, list)) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, each a text or token ids: a list of texts or of token-id
        lists is a batch (OpenAI's and vLLM's legacy completions), anything else one prompt."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]

    @model_validator(mode="after")
    def _batch_bounds(self) -> "CompletionRequest":
        prompts = len(self.prompts)
        sequences = prompts * max(self.best_of or 1, self.n or 1)
        if sequences > MAX_BATCH_SEQUENCES:
            raise ValueError(f"{prompts} prompts of {sequences // prompts} sequences each are {sequences} "
                             f"sequences, more than {MAX_BATCH_SEQUENCES} in one request")
        if prompts > 1 and self.resumable:
            # as with n: a resumable stream's events and takeover carry one sequence
            raise ValueError(f"stream_options.resumable needs one prompt, got {prompts}")
        return self
