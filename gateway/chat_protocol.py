"""The /v1/chat/completions request body: messages, tools and tool choice, on the sampling
fields both endpoints share (``tandem.gateway.protocol``), validated as strictly: a wrong type is a
400, the deprecated ``functions`` / ``function_call`` are accepted only empty, and a tool call's
arguments must be JSON.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tandem.cluster.sampling import MAX_LOGPROBS
from tandem.gateway.protocol import SamplingFields, StrictModel, TextPart


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (none: no arguments)
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class ToolName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolName


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_arguments(cls, value: list[ToolCall] | None) -> list[ToolCall] | None:
        for call in value or []:
            try:
                json.loads(call.function.arguments)
            except ValueError as exc:
                raise ValueError(f"tool call {call.function.name!r}: arguments are not JSON: {exc}") from None
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)  # as vLLM joins text parts
        return self.content or ""


# apply_chat_template's own arguments: set by the request's fields, never by chat_template_kwargs
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict", "padding",
                                "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                                "tokenizer_kwargs"})


class ChatTemplateFields(StrictModel):
    """What the chat template renders: the messages and vLLM's controls of the rendering (the
    chat completion and /tokenize's chat form share them)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    continue_final_message: bool = False  # the last message left open, the output continuing it
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the template (e.g. enable_thinking)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(TEMPLATE_ARGUMENTS & set(value or {}))
        if reserved:
            raise ValueError(f"{reserved} are set by the request's own fields, not by chat_template_kwargs")
        return value

    @model_validator(mode="after")
    def _one_open_turn(self) -> "ChatTemplateFields":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt "
                             "set to false")
        return self


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
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

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value:
            raise ValueError("the deprecated functions and function_call are not supported: use tools and tool_choice")
        return value

    @model_validator(mode="after")
    def _tool_choice_has_tools(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not in tools")
        if self.calls_tools and self.structured is not None:
            raise ValueError("tool calls and a structured output cannot be asked for together")
        if self.calls_tools and self.resumable:
            raise ValueError("stream_options.resumable is not available with tools (a resumed stream's "
                             "calls would be read from its middle)")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the model may or must call a tool (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @model_validator(mode="after")
    def _one_max(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:  # the newer name wins, as in OpenAI and vLLM
            self.max_tokens = self.max_completion_tokens
        return self
