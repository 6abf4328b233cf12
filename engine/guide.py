"""Structured outputs on the worker that samples: one llguidance matcher per guided request.

A request whose ``SamplingParams.grammar`` is set samples only tokens its grammar
allows. The matcher's state is the tokens accepted so far, nothing else: a
``Guide`` catches up by consuming whatever tokens it has not seen (``sync``), so
the state crosses the prefill -> decode handoff (the decode worker's guide
consumes the first token the prefill worker sampled) and is rebuilt by replaying
the output tokens wherever a request moves (resumed after a pause, failed over to
another decode worker with its output so far).

``Guides`` holds the worker's llguidance tokenizer (built on the first guided
request, from the same tokenizer files the gateway uses) and turns a batch's
guides into one bitmask ([rows, ceil(V / 32)] int32 on the host, bit t of a row:
token t allowed), copied to the device and applied to the logits before
anything else touches them. The host fills the bitmask while the device runs the
step's forward (the forward is launched first); on the CPU the forward has
already finished by then.
"""

from __future__ import annotations

import structlog
import torch

log = structlog.get_logger(__name__)

class Guide:
    """One request's grammar state: the tokens it accepted, a matcher in the state they lead to."""

    def __init__(self, matcher, eos_token_ids: list[int]):
        self.matcher = matcher
        self.eos_token_ids = list(eos_token_ids)
        self.num_accepted = 0
        self.error: str | None = None

    def sync(self, token_ids: list[int], pending: list[int] = ()) -> None:
        """Consume what it has not of ``token_ids`` (the output so far) followed by ``pending``
        (tokens sampled but not yet in the output; passed apart, so a step copies no output)."""
        total = len(token_ids) + len(pending)
        done = self.num_accepted
        new = token_ids[done:] + list(pending[max(0, done - len(token_ids)):])
        self.num_accepted = max(done, total)
        if not new or self.error is not None:
            return
        if self.matcher.is_stopped():  # its end reached: only EOS follows, and nothing after it
            return
        if not self.matcher.consume_tokens(new):
            self.error = self.matcher.get_error() or "a token outside the grammar"
            log.error("guided output left its grammar", error=self.error)

    def fill(self, row: torch.Tensor) -> None:
        """This step's allowed tokens into ``row`` ([W] int32, contiguous, on the host). A guide in
        error, or one with nothing left to allow, allows only EOS: the request ends."""
        if self.error is None:
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if self.matcher.is_error():
                self.error = self.matcher.get_error()
            elif bool(row.any()):
                return
        row.zero_()
        for token in self.eos_token_ids:
            if token < row.numel() * 32:
                row[token // 32] |= _bit(token % 32)


def _bit(i: int) -> int:
    return -(1 << 31) if i == 31 else 1 << i  # int32: bit 31 is the sign bit


class Guides:
    """The worker's guided-decoding state: its llguidance tokenizer and the bitmask of a step."""

    def __init__(self, tokenizer_source: str, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer_source = tokenizer_source  # a checkpoint directory or GGUF file (cluster.tokenizer)
        self.vocab_size = vocab_size  # the model's logits width: the mask covers every column
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._mask_vocab = vocab_size  # the masks' width: the wider of the logits and the tokenizer

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            from tandem.cluster.grammars import ll_tokenizer
            from tandem.cluster.tokenizer import load_tokenizer, vocab_size

            tokenizer = load_tokenizer(self.tokenizer_source)
            self._mask_vocab = max(self.vocab_size, vocab_size(tokenizer))
            self._ll_tokenizer = ll_tokenizer(tokenizer, self._mask_vocab)
        return self._ll_tokenizer

    def new(self, grammar: str, output_token_ids: list[int] = ()) -> Guide:
        """A guide for ``grammar`` that has consumed ``output_token_ids`` (a request that moved)."""
        from llguidance import LLMatcher

        guide = Guide(LLMatcher(self.ll_tokenizer, grammar, log_level=0), self.eos_token_ids)
        if guide.matcher.is_error():
            guide.error = guide.matcher.get_error()
            log.error("grammar refused by the worker", error=guide.error)
        guide.sync(list(output_token_ids))
        return guide

    def bitmask(self, guides: list[Guide | None]) -> torch.Tensor | None:
        """[B, W] int32 on the host: each guided row's allowed tokens, every bit set for the
        others; None when no row is guided."""
        if not any(g is not None for g in guides):
            return None
        words = (self._mask_vocab + 31) // 32  # the guides exist: their tokenizer was built
        mask = torch.full((len(guides), words), -1, dtype=torch.int32)
        for row, guide in enumerate(guides):
            if guide is not None:
                guide.fill(mask[row])
        return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with every token whose bit is clear at -inf (device ops only; the
    bitmask goes to the device without making the host wait)."""
    device = logits.device
    if device.type == "cuda":
        bitmask = bitmask.pin_memory().to(device, non_blocking=True)
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
