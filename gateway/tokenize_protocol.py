"""vLLM's /tokenize and /detokenize bodies: the tokenizer of the served model, as the generation
endpoints use it (a chat form renders the chat template as /v1/chat/completions does), for a
client that counts or inspects tokens before it sends a request."""

from __future__ import annotations

import json

from pydantic import Field

from tandem.gateway.chat_protocol import ChatTemplateFields, Tool
from tandem.gateway.protocol import StrictModel


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions encodes a prompt
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = False  # the template writes its own
    return_token_strs: bool = False

    @property
    def calls_tools(self) -> bool:
        """Tools given: the template renders them, as it would for a chat completion that may call one."""
        return bool(self.tools)


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def parse_tokenize(raw: bytes) -> TokenizeRequest:
    """A /tokenize body in its form: the chat form when it has ``messages``, else the completion
    form (so a bad body's error names the field of its own form; raises pydantic's ValidationError)."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None  # the form's own parse names the JSON error
    form = TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest
    return form.model_validate_json(raw)


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)
