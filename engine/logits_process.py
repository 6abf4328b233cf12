"""Logits processing before sampling: ``logit_bias`` and the penalties (``SamplingParams``).

In the order ``tandem.cluster.sampling`` documents (after the structured-output mask,
before temperature): each row's ``logit_bias`` is added to its logits; then, for a row
with a repetition penalty p, every token of its prompt or output has its logit l
replaced by ``l * p`` if l < 0 else ``l / p`` (HF's ``RepetitionPenaltyLogitsProcessor``);
then ``frequency_penalty * count + presence_penalty * (count > 0)`` is subtracted, with
count the token's occurrences in the row's output (OpenAI's rule: generated tokens only).

Everything runs on the logits' device from small host-built index tensors copied
without making the host wait (``tandem.engine.sampler._to_device``): the decode loop
launches the next step before this one's tokens reach the host, so nothing here may
read device data back. The caller's logits are never changed (logprobs are the raw
distribution): ``process`` returns a new tensor. The counts and prompt marks of
penalized rows come from ``tandem.engine.penalty_slots`` on the decode worker, and from
the prompt alone for a request's first token (``first_token``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.cluster.sampling import SamplingParams
from tandem.engine.sampler import _to_device


class Penalized(NamedTuple):
    """The rows of a batch that carry penalties, with what the penalties look at."""

    rows: list[int]  # batch rows, ascending
    prompt: torch.Tensor  # [R, V] bool on the logits' device: the tokens of each row's prompt
    counts: torch.Tensor | None  # [R, V] fp32: each token's occurrences in the row's output (None: no output yet)


def process(logits: torch.Tensor, params: list[SamplingParams], penalized: Penalized | None = None) -> torch.Tensor:
    """logits [B, V] fp32, one ``SamplingParams`` per row -> a processed copy (``logits`` itself when
    no row asks for anything). ``penalized``: required when a row is ``penalized``."""
    if not any(p.processed for p in params):
        return logits
    out = _add_bias(logits, params)
    if penalized is not None and penalized.rows:
        out = _penalize(out, [params[r] for r in penalized.rows], penalized)
    return out


def first_token(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]]) -> torch.Tensor:
    """``process`` for rows sampling their first output token: repetition over the prompt only,
    no output counts yet (the prefill worker's rows)."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    penalized = None
    if rows:
        penalized = Penalized(rows, prompt_marks(logits.shape[-1], [prompts[r] for r in rows], logits.device), None)
    return process(logits, params, penalized)


def prompt_marks(vocab: int, prompts: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(prompts), vocab] bool: True at each row's prompt tokens."""
    marks = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
    index = _to_device(torch.tensor([[r for r, ids in enumerate(prompts) for _ in ids],
                                     [t for ids in prompts for t in ids]], dtype=torch.int64), device)
    marks[index[0], index[1]] = True
    return marks


def _add_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """A copy of ``logits`` with every row's ``logit_bias`` added (ids outside the logits, which
    the model cannot produce anyway, are left out rather than indexed)."""
    out = logits.clone()
    vocab = logits.shape[-1]
    entries = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias if 0 <= t < vocab]
    if entries:
        rows, cols, biases = zip(*entries)
        index = _to_device(torch.tensor([rows, cols], dtype=torch.int64), logits.device)
        values = _to_device(torch.tensor(biases, dtype=logits.dtype), logits.device)
        out.index_put_((index[0], index[1]), values, accumulate=True)
    return out


def _penalize(out: torch.Tensor, params: list[SamplingParams], penalized: Penalized) -> torch.Tensor:
    """Apply the penalties of ``penalized.rows`` (``params``: theirs) to ``out`` in place -> ``out``."""
    device = out.device
    every_row = len(penalized.rows) == out.shape[0]
    rows = None if every_row else _to_device(torch.tensor(penalized.rows, dtype=torch.int64), device)
    logits = out if every_row else out[rows]
    counts = penalized.counts
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = _to_device(torch.tensor([[p.repetition_penalty] for p in params], dtype=out.dtype), device)
        seen = penalized.prompt if counts is None else penalized.prompt | (counts > 0)
        repeated = torch.where(logits < 0, logits * penalty, logits / penalty)  # HF's rule, as it computes it
        logits = torch.where(seen, repeated, logits)
    if counts is not None and any(p.frequency_penalty or p.presence_penalty for p in params):
        weights = _to_device(torch.tensor([[p.frequency_penalty, p.presence_penalty] for p in params],
                                          dtype=out.dtype), device)
        logits = logits - (weights[:, :1] * counts + weights[:, 1:] * (counts > 0))
    if every_row:
        return logits
    out[rows] = logits
    return out
