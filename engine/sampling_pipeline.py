"""One sampling pipeline: what every step runs between its logits and its tokens, whichever
rows it holds (a decode step's rows, a prompt's first token, or both in one mixed step).

In the order ``tandem.cluster.sampling`` documents: the structured-output mask, then the
logits processing (``logit_bias`` and penalties: a decode row's counts from its slot on the
device, a first token's from its prompt alone), then sampling with the banned tokens of
``min_tokens``; logprobs are the model's own distribution, from the logits before any of it.
Nothing here waits for the device: a decode step launches the next one before its tokens
are read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from tandem.cluster.request_state import banned_token_ids
from tandem.cluster.sampling import SamplingParams
from tandem.engine import logits_process, logprobs
from tandem.engine.guide import Guides, apply_bitmask
from tandem.engine.sampler import sample_async


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [R] int64 on the logits' device
    logprobs: tuple[torch.Tensor, ...] | None  # logprobs.compute's tensors, when a row asked


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], indices: list[int], *,
                bitmask: torch.Tensor | None = None, banned: list[list[int]] | None = None,
                process: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Sampled:
    """logits [R, V] fp32 -> the rows' tokens. ``indices``: the output index each row samples (a
    seeded row's draw depends on it); ``bitmask``: the rows' structured-output masks (host, as
    ``Guides.bitmask``); ``process``: the rows' logit_bias and penalties."""
    raw = logits
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    if process is not None:
        logits = process(logits)
    tokens = sample_async(logits, params, indices, banned)
    extra = logprobs.compute(raw, tokens, params) if logprobs.wanted(params) else None
    return Sampled(tokens, extra)


class FirstToken(NamedTuple):
    """A request sampling its first output token at the end of its prompt."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # what its repetition penalty counts
    stop_token_ids: Sequence[int]
    ignore_eos: bool


def sample_first_tokens(logits: torch.Tensor, rows: list[FirstToken], eos_token_ids: Sequence[int],
                        guides: Guides | None) -> Sampled:
    """The first tokens of ``rows`` (logits [R, V] of each prompt's last token): a structured
    output's grammar starts here, the repetition penalty counts the prompt alone."""
    params = [row.params for row in rows]
    banned = [banned_token_ids(row.params, 0, row.stop_token_ids, eos_token_ids, row.ignore_eos) for row in rows]
    bitmask = None
    if guides is not None and any(p.grammar for p in params):
        bitmask = guides.bitmask([guides.new(p.grammar) if p.grammar else None for p in params])
    prompts = [row.prompt_token_ids for row in rows]
    return sample_rows(logits, params, [0] * len(rows), bitmask=bitmask, banned=banned,
                       process=lambda out: logits_process.first_token(out, params, prompts))


def host_entries(sampled: Sampled, params: list[SamplingParams]) -> list[list | None]:
    """One engine.logprobs entry per row (None: the row did not ask); waits for the device."""
    if sampled.logprobs is None:
        return [None] * len(params)
    return logprobs.entries(tuple(t.cpu() for t in sampled.logprobs), params)
