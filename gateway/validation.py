"""Validated request bodies -> ``GenerationInput``: tokenized, within every limit.

Everything here raises ``InvalidRequest`` (400) or ``ModelNotFound`` (404),
so a request that passes is one a worker can run: a known model (the base model,
or the served LoRA adapter the caller resolved it to: ``tandem.gateway.lora_adapters``), a non-empty
prompt of at most ``max_input_len`` tokens, token ids inside the vocabulary,
``prompt + max_tokens <= max_seq_len`` and a finite temperature (what the wire
messages' rules in ``tandem.cluster.messages`` accept).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from tandem.cluster import grammars
from tandem.cluster.grammars import GrammarError, Grammars
from tandem.cluster.lora_registry import LoraRecord
from tandem.cluster.sampling import SamplingParams
from tandem.cluster.settings import Settings
from tandem.cluster.tokenizer import vocab_size
from tandem.gateway import tools
from tandem.gateway.errors import InvalidRequest, ModelNotFound
from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.protocol import INT64_MAX, CompletionRequest, SamplingFields, StructuredOutputs
from tandem.gateway.tokenize_protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest


@dataclass
class GenerationInput:
    """What one generation needs, independent of the endpoint it came from."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1  # choices: each its own generation (gateway.choices)
    best_of: int = 1  # sequences sampled; the n with the highest cumulative logprob are returned
    echo: bool = False  # completions: the prompt (with its logprobs, when asked) leads the choice
    tool_parser: str | None = None  # chat with tools: the format its output's calls are read in (gateway.tools)
    prompt_text: str | None = None  # with echo: the prompt's text as the client sent it (token ids: decoded)
    # the LoRA adapter the request names as its model ("": the base model): its name, the directory
    # the workers read it from and the digest of its weights, as served when the request arrived
    lora_name: str = ""
    lora_path: str = ""
    lora_digest: str = ""

    def with_adapter(self, adapter: LoraRecord | None) -> "GenerationInput":
        if adapter is not None:
            self.lora_name, self.lora_path, self.lora_digest = adapter.name, adapter.path, adapter.digest
        return self


def choice_input(inp: GenerationInput, index: int) -> GenerationInput:
    """Choice ``index`` of a request: a seeded one samples with seed + index (wrapped to int64),
    so its choices differ and each can be reproduced; the rest is the request's."""
    if index == 0 or inp.sampling.seed is None:
        return inp
    seed = inp.sampling.seed + index
    if seed > INT64_MAX:
        seed -= 2**64
    return replace(inp, sampling=replace(inp.sampling, seed=seed))


class Validator:
    def __init__(self, settings: Settings, tokenizer, grammar_checker: Grammars | None = None):
        self.settings = settings
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size(tokenizer)
        self.model_names = {settings.model_name, settings.model}
        self.grammars = grammar_checker or Grammars(tokenizer, self.vocab_size)

    def completion(self, body: CompletionRequest, adapter: LoraRecord | None = None) -> list[GenerationInput]:
        """One input per prompt of the request (``body.prompts``: a batch is several), each within
        every limit; ``adapter``: the LoRA adapter ``body.model`` names (None: the base model). A
        prompt of a batch that fails names its index in the error."""
        self._check_model(body.model, adapter)
        grammar = self._grammar(body.structured, self._structured_param(body))
        prompts = body.prompts
        inputs = []
        for index, prompt in enumerate(prompts):
            try:
                inputs.append(self._completion_input(body, prompt, grammar, adapter))
            except InvalidRequest as exc:
                if len(prompts) == 1:
                    raise
                raise InvalidRequest(f"prompt {index} of {len(prompts)}: {exc.message}", param=exc.param,
                                     code=exc.code) from exc
        return inputs

    def _completion_input(self, body: CompletionRequest, prompt: str | list[int], grammar: str | None,
                          adapter: LoraRecord | None) -> GenerationInput:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            token_ids = self._encode(prompt, "prompt", add_special_tokens=True)
        else:
            token_ids = list(prompt)
            self._check_vocab(token_ids, "prompt")
        inp = self._build(body, token_ids, grammar).with_adapter(adapter)
        if inp.echo:
            inp.prompt_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(
                token_ids, skip_special_tokens=body.skip_special_tokens)
        return inp

    def chat(self, body: ChatCompletionRequest, adapter: LoraRecord | None = None) -> GenerationInput:
        """``adapter``: the LoRA adapter ``body.model`` names (None: the base model)."""
        self._check_model(body.model, adapter)
        token_ids, parser = self._render_chat(body)
        grammar = self._grammar(body.structured, self._structured_param(body))
        if body.calls_tools:
            grammar = self._tool_grammar(body, parser)
        inp = self._build(body, token_ids, grammar).with_adapter(adapter)
        if body.calls_tools:
            inp.tool_parser = parser
            if parser == "mistral":  # its marker is a special token: the parser reads it in the text
                inp.skip_special_tokens = False
        return inp

    def tokenize(self, body: TokenizeRequest, adapter: LoraRecord | None = None) -> list[int]:
        """/tokenize: the token ids a prompt (or, in the chat form, the rendered chat template) is
        sent as, without the generation endpoints' length limits."""
        self._check_model(body.model, adapter)
        if isinstance(body, TokenizeChatRequest):
            return self._render_chat(body, body.add_special_tokens)[0]
        return self._encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)

    def detokenize(self, body: DetokenizeRequest, adapter: LoraRecord | None = None) -> str:
        self._check_model(body.model, adapter)
        self._check_vocab(body.tokens, "tokens")
        return self.tokenizer.decode(body.tokens)

    def _render_chat(self, body: ChatCompletionRequest | TokenizeChatRequest,
                     add_special_tokens: bool = False) -> tuple[list[int], str | None]:
        """The messages through the chat template (with the tools, when the model may call one)
        -> (token ids, the tool-call format of the template, None without tools)."""
        template = self._template()
        parser = tools.parser_for(template, self.settings.tool_call_parser) if body.tools else None
        messages = [self._message(m, parser, template) for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        if body.calls_tools:
            specs = [t.model_dump(exclude_none=True) for t in body.tools]
            if "tools" in template:
                kwargs["tools"] = specs
            else:  # a template that does not render tools: they go in a system message of the parser's format
                messages.insert(0, {"role": "system", "content": tools.tools_system_prompt(parser, specs)})
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                      continue_final_message=body.continue_final_message,
                                                      tokenize=False, **kwargs)
        except Exception as exc:  # jinja raises its own types (e.g. a template that rejects a role order)
            raise InvalidRequest(f"cannot apply the chat template: {exc}", param="messages") from exc
        return self._encode(text, "messages", add_special_tokens=add_special_tokens), parser

    def _template(self) -> str:
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return template if isinstance(template, str) else "\n".join(map(str, dict(template).values()))

    @staticmethod
    def _message(m, parser: str | None, template: str) -> dict:
        """One message as chat templates take it: a call's arguments as a mapping (HF templates
        render them with tojson), tool results with their call id; for a template that renders
        no tool calls, the assistant's calls are written into its content in the parser's format."""
        message: dict = {"role": m.role, "content": m.text}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                     for c in m.tool_calls]
            if "tool_calls" in template:
                message["tool_calls"] = calls
            else:
                message["content"] = (message["content"] + "\n" if message["content"] else "") + \
                    tools.render_calls(parser or "hermes", calls)
        return message

    def _tool_grammar(self, body: ChatCompletionRequest, parser: str) -> str | None:
        """tool_choice "required" or a named function: the grammar that forces the call (None: auto)."""
        choice = body.tool_choice
        if choice in (None, "auto"):
            return None
        functions = [t.function for t in body.tools]
        if choice != "required":
            functions = [f for f in functions if f.name == choice.function.name]
        parallel = body.parallel_tool_calls is not False and choice == "required"
        lark = tools.forced_grammar(parser, functions, parallel, self._special_token_id)
        try:
            return self.grammars.check(grammars.lark_grammar(lark))
        except GrammarError as exc:
            raise InvalidRequest(f"invalid tool parameters schema: {exc}", param="tools") from exc

    def _special_token_id(self, text: str) -> int | None:
        """The id of ``text`` when the tokenizer has it as one special token."""
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        added = {i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if t.special}
        return token_id if isinstance(token_id, int) and token_id in special | added else None

    @staticmethod
    def _structured_param(body: SamplingFields) -> str:
        fields = body.structured_output_fields
        return fields[0] if fields else "response_format"

    def _grammar(self, spec: StructuredOutputs | None, param: str = "response_format") -> str | None:
        """The llguidance grammar of a structured output, checked against the tokenizer (400 if refused)."""
        if spec is None:
            return None
        try:
            if spec.json_object:
                grammar = grammars.json_schema_grammar({"type": "object"}, spec.whitespace_pattern)
            elif spec.json_ is not None:
                schema = spec.json_
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except ValueError as exc:
                        raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
                grammar = grammars.json_schema_grammar(schema, spec.whitespace_pattern,
                                                       closed=spec.disable_additional_properties)
            elif spec.regex is not None:
                grammar = grammars.regex_grammar(spec.regex)
            elif spec.choice is not None:
                grammar = grammars.choice_grammar(spec.choice)
            else:
                grammar = grammars.lark_grammar(spec.grammar)
            return self.grammars.check(grammar)
        except GrammarError as exc:
            raise InvalidRequest(f"invalid structured output: {exc}", param=param) from exc

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        try:
            text.encode("utf-8")  # a lone surrogate ("\ud800" in the JSON) is not text the tokenizer takes
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"{param} cannot be tokenized: {exc}", param=param) from exc

    def _build(self, body: SamplingFields, prompt_token_ids: list[int], grammar: str | None = None) -> GenerationInput:
        num_prompt = len(prompt_token_ids)
        max_seq_len, max_input_len = self.settings.max_seq_len, self.settings.max_input_len
        if num_prompt == 0:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if num_prompt > max_input_len:
            raise InvalidRequest(
                f"prompt has {num_prompt} tokens, more than the maximum input length {max_input_len}",
                param="prompt", code="context_length_exceeded",
            )
        max_tokens = body.max_tokens if body.max_tokens is not None else max_seq_len - num_prompt
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        scores_prompt = bool(getattr(body, "echo", False)) or body.prompt_logprobs is not None
        if max_tokens < 1 and not (max_tokens == 0 and body.max_tokens == 0 and scores_prompt):
            # 0 asked for: the prompt is scored (echo or prompt_logprobs), nothing generated
            raise InvalidRequest(f"{name} must be at least 1 (0 only with echo or prompt_logprobs), got {max_tokens}",
                                 param=name)
        if num_prompt + max_tokens > max_seq_len:
            raise InvalidRequest(
                f"prompt ({num_prompt} tokens) + {name} ({max_tokens}) exceeds the maximum "
                f"sequence length {max_seq_len}",
                param=name, code="context_length_exceeded",
            )
        if body.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({body.min_tokens}) is more than {name} ({max_tokens})",
                                 param="min_tokens")
        if grammar is not None and body.min_tokens:
            # a grammar that has ended allows only EOS, which min_tokens bans: nothing could be sampled
            raise InvalidRequest("min_tokens cannot be combined with a structured output or forced tool call",
                                 param="min_tokens")
        stop_token_ids = list(body.stop_token_ids or [])
        self._check_vocab(stop_token_ids, "stop_token_ids")
        if body.temperature is not None and not math.isfinite(body.temperature):
            # the workers refuse it (tandem.cluster.messages): an infinite temperature poisons sampling
            raise InvalidRequest(f"temperature must be finite, got {body.temperature}", param="temperature")
        top_k = body.top_k if body.top_k and body.top_k > 0 else 0
        logit_bias = tuple((int(token), float(bias)) for token, bias in (body.logit_bias or {}).items())
        self._check_vocab([token for token, _ in logit_bias], "logit_bias")
        echo = bool(getattr(body, "echo", False))
        prompt_logprobs = body.prompt_logprobs
        if echo and prompt_logprobs is None and getattr(body, "requested_logprobs", None) is not None:
            prompt_logprobs = body.requested_logprobs  # echo with logprobs: the prompt's come with the completion's
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=top_k,
            seed=body.seed,
            logprobs=getattr(body, "requested_logprobs", None),
            min_tokens=body.min_tokens,
            presence_penalty=float(body.presence_penalty or 0.0),
            frequency_penalty=float(body.frequency_penalty or 0.0),
            repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
            logit_bias=logit_bias,
            min_p=float(body.min_p or 0.0),
            grammar=grammar,
            prompt_logprobs=prompt_logprobs,
        )
        return GenerationInput(
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            stop=body.stop_strings,
            stop_token_ids=stop_token_ids,
            ignore_eos=body.ignore_eos,
            priority=body.priority,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            n=body.n or 1,
            best_of=max(body.best_of or 1, body.n or 1),
            echo=echo,
        )

    def _check_model(self, model: str | None, adapter: LoraRecord | None = None) -> None:
        if adapter is not None and model == adapter.name:
            return
        if model is not None and model not in self.model_names:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves "
                                f"{self.settings.model_name!r}", param="model")

    def _check_vocab(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"{param} contains token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                param=param,
            )
