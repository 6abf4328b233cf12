"""One choice's text: token ids in, OpenAI deltas out (no I/O).

``TextStream.advance`` takes the token ids a worker released (in output
order, as ``streams.TokenAssembler`` orders them) and the worker's finish
reason, detokenizes incrementally, applies the stop strings and returns the
``Delta`` the client may be sent now. With ``min_tokens`` it feeds the text
token by token, so that (as vLLM) no stop string may end in the text of the
first min_tokens tokens, whatever batches the tokens arrive in.

A choice's first delta carries what leads it of its prompt (``responses.PromptPart``): with
echo the prompt's text, and the prompt's logprobs when asked (``prompt_logprobs``, set from
the prefill worker's first event).

``catch_up`` feeds tokens whose text the client already has (a resumable
stream continued by another gateway): the detokenizer's window, the stop
strings' held-back text and the token counts end where the first gateway's
were after those tokens, since neither depends on how the tokens were batched.
"""

from __future__ import annotations

from tandem.gateway.detokenizer import IncrementalDetokenizer
from tandem.gateway.responses import Delta, PromptPart
from tandem.gateway.stop import StopChecker
from tandem.gateway.validation import GenerationInput


class TextStream:
    def __init__(self, tokenizer, inp: GenerationInput):
        self._min_tokens = inp.sampling.min_tokens
        self._wants_logprobs = inp.sampling.logprobs is not None
        self._detokenizer = IncrementalDetokenizer(tokenizer, inp.prompt_token_ids, inp.skip_special_tokens)
        self._stop = StopChecker(inp.stop, inp.include_stop_str_in_output)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list = []  # one entry per output token, when the request asked for logprobs
        self.finish_reason: str | None = None
        self._echo = None
        if inp.echo:
            self._echo = inp.prompt_text if inp.prompt_text is not None else tokenizer.decode(
                inp.prompt_token_ids, skip_special_tokens=inp.skip_special_tokens)
        self._wants_prompt_logprobs = inp.sampling.prompt_logprobs is not None
        self.prompt_logprobs: list | None = None  # engine.prompt_logprobs entries, once a worker sent them
        self._prompt_sent = False  # the first delta (which carries the prompt) was made

    @property
    def prompt(self) -> PromptPart | None:
        """What leads this choice of its prompt (None: nothing asked)."""
        if self._echo is None and not self._wants_prompt_logprobs:
            return None
        return PromptPart(self._echo, self.prompt_logprobs if self._wants_prompt_logprobs else None)

    @property
    def text(self) -> str:
        return self._stop.text

    @property
    def stopped_by_string(self) -> bool:
        """A stop string ended the text (the worker may still be generating)."""
        return self._stop.stopped

    def advance(self, new_token_ids: list[int], worker_finish: str | None,
                new_logprobs: list | None = None) -> Delta | None:
        """New tokens -> the text that may be sent now; sets ``finish_reason`` at the end."""
        if not new_token_ids and worker_finish is None:
            return None
        self.output_token_ids.extend(new_token_ids)
        logprobs = None
        if self._wants_logprobs:
            logprobs = list(new_logprobs or [None] * len(new_token_ids))
            self.output_logprobs.extend(logprobs)
        # "stop" from a worker means the last token is EOS or a stop token: its text is not output
        text_token_ids = new_token_ids[:-1] if worker_finish == "stop" else new_token_ids
        text = self._feed(text_token_ids, len(self.output_token_ids) - len(new_token_ids))
        if self._stop.stopped:
            self.finish_reason = "stop"
        elif worker_finish is not None:
            self.finish_reason = worker_finish
            text += self._stop.feed(self._detokenizer.flush())
            text += "" if self._stop.stopped else self._stop.flush()
            if self._stop.stopped:  # the released tail held a stop string
                self.finish_reason = "stop"
        delta = Delta(text, new_token_ids, self.finish_reason, logprobs)
        if not self._prompt_sent:
            self._prompt_sent = True
            delta.prompt = self.prompt
        return delta

    def catch_up(self, batches: list[list[int]]) -> None:
        """Take output tokens already sent as text (in the batches they were sent in); nothing is
        returned: the text they make was the client's before."""
        for token_ids in batches:
            if token_ids:
                self.advance(token_ids, None)

    def _feed(self, token_ids: list[int], num_before: int) -> str:
        """Detokenize ``token_ids`` (output tokens num_before on) through the stop strings."""
        min_tokens = self._min_tokens
        if num_before + len(token_ids) <= min_tokens or num_before >= min_tokens:
            return self._stop.feed(self._detokenizer.add(token_ids), match=num_before >= min_tokens)
        text = ""
        for offset, token_id in enumerate(token_ids):
            text += self._stop.feed(self._detokenizer.add([token_id]), match=num_before + offset >= min_tokens)
            if self._stop.stopped:
                break
        return text
