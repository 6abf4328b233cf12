"""Logits processing before sampling: ``logit_bias`` and the penalties (``SamplingParams``).

In the order ``tandem.cluster.sampling`` documents (after the structured-output mask,
before temperature): each row's ``logit_bias`` is added to its logits; then, for a row
with a repetition penalty p, every token of its prompt or output has its logit l
replaced by ``l * p`` if l < 0 else ``l / p`` (HF's ``RepetitionPenaltyLogitsProcessor``);
then ``frequency_penalty * count + presence_penalty * (count > 0)`` is subtracted, with
count the token's occurrences in the row's output (OpenAI's rule: generated tokens only).

Everything runs on the logits' device from small host-built index tensors copied
without making the host wait (``tandem.engine.device_copy.to_device``): the decode loop
launches the next step before this one's tokens reach the host, so nothing here may
read device data back. The caller's logits are never changed (logprobs are the raw
distribution): ``apply`` returns a new tensor. The counts and prompt marks of
penalized rows come from ``tandem.engine.penalty_slots`` on the decode worker, and from
the prompt alone for a request's first token (``first_token``); the penalties themselves
are one kernel on CUDA (``tandem.kernels.penalties``), the torch reference elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.cluster.sampling import SamplingParams
from tandem.engine.device_copy import to_device
from tandem.kernels import ops


class Plan(NamedTuple):
    """A step's processing as device tensors, built from its rows' parameters (``plan``); the
    decode worker reuses it while its batch and their slots stay the same."""

    bias: tuple[torch.Tensor, torch.Tensor] | None  # ([N] int64 row * V + token, [N] fp32 bias)
    penalties: tuple[torch.Tensor, torch.Tensor] | None  # ([2, R] int64 (row, slot), [R, 3] fp32
    #                                                     (repetition, frequency, presence))


def plan(params: list[SamplingParams], vocab: int, device: torch.device,
         slots: dict[int, int] | None = None) -> Plan | None:
    """The processing of a batch's rows (None: no row asks for any). ``slots``: for each penalized
    row, its slot in the counts and prompt buffers ``apply`` is given."""
    if not any(p.processed for p in params):
        return None
    bias = None
    entries = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias if 0 <= t < vocab]
    if entries:  # ids outside the logits (the model cannot produce them anyway) are left out
        bias = (to_device(torch.tensor([r * vocab + t for r, t, _ in entries], dtype=torch.int64), device),
                to_device(torch.tensor([b for _, _, b in entries], dtype=torch.float32), device))
    penalties = None
    if slots:
        rows = sorted(slots)
        weights = [[params[r].repetition_penalty, params[r].frequency_penalty, params[r].presence_penalty]
                   for r in rows]
        penalties = (to_device(torch.tensor([rows, [slots[r] for r in rows]], dtype=torch.int64), device),
                     to_device(torch.tensor(weights, dtype=torch.float32), device))
    return Plan(bias, penalties)


def apply(logits: torch.Tensor, plan: Plan | None, counts: torch.Tensor | None = None,
          prompt: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp32 -> a processed copy (``logits`` itself for no plan). ``counts`` [C, V]
    fp32 and ``prompt`` [C, V] bool: the slots the plan's penalized rows read."""
    if plan is None:
        return logits
    out = logits.clone(memory_format=torch.contiguous_format)
    if plan.bias is not None:
        index, values = plan.bias
        out.view(-1).index_add_(0, index, values)  # one atomic add per entry (index_put's accumulate sorts)
    if plan.penalties is not None:
        index, weights = plan.penalties
        ops.apply_penalties(out, index[0], index[1], counts, prompt, weights)
    return out


def first_token(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]]) -> torch.Tensor:
    """The processed logits of rows sampling their first output token: repetition over the
    prompt only, no output counts yet (the prefill worker's rows)."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    vocab, device = logits.shape[-1], logits.device
    counts = prompt = None
    if rows:
        counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
        prompt = prompt_marks(vocab, [prompts[r] for r in rows], device)
    return apply(logits, plan(params, vocab, device, {r: i for i, r in enumerate(rows)}), counts, prompt)


def prompt_marks(vocab: int, prompts: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(prompts), vocab] bool: True at each row's prompt tokens."""
    marks = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
    index = to_device(torch.tensor([[r for r, ids in enumerate(prompts) for _ in ids],
                                     [t for ids in prompts for t in ids]], dtype=torch.int64), device)
    marks[index[0], index[1]] = True
    return marks
