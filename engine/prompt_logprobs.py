"""Log-probabilities of a prompt's own tokens (``SamplingParams.prompt_logprobs``), chunk by chunk.

The logits at position i give the distribution of the token at i + 1, so a prompt chunk
covering positions [start, start + n) scores prompt tokens start + 1 .. start + n (the last
position of the prompt scores nothing: its logits are the first output token's). The
prefill worker runs this over each chunk's final hidden states as the chunk is computed;
full-vocabulary logits are made only for ``rows_per_slice`` positions at a time, so a long
prompt's [prompt, vocab] logits never exist at once.

One entry per scored token, as ``tandem.engine.logprobs`` shapes them, plus the token's rank
in the distribution (1 = the most likely; vLLM returns it)::

    [token's logprob, [[token id, logprob], ... the k most likely], rank]

The prompt's first token has no entry (None): nothing precedes it. Like the sampled tokens'
logprobs these are the model's own distribution (raw logits, no temperature), -inf as -9999.0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.cluster.sampling import MAX_LOGPROBS
from tandem.engine.device_copy import tensor_on
from tandem.engine.logprobs import FLOOR

SLICE_ELEMENTS = 1 << 24  # fp32 logits made at once (64 MiB): rows_per_slice = this // vocab


def rows_per_slice(vocab_size: int) -> int:
    return max(1, SLICE_ELEMENTS // max(vocab_size, 1))


def num_scored(start: int, num_tokens: int, num_prompt_tokens: int) -> int:
    """How many prompt tokens a chunk of ``num_tokens`` positions from ``start`` scores."""
    return max(min(num_tokens, num_prompt_tokens - 1 - start), 0)


def chunk_entries(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  next_token_ids: list[int], k: int, slice_rows: int) -> list[list]:
    """Entries of the tokens ``next_token_ids`` (the prompt's tokens one past each row of ``hidden``).

    ``hidden``: [n, hidden] final-normed states of the chunk's first n positions (n =
    len(next_token_ids)); ``compute_logits``: [r, hidden] -> [r, vocab] logits (the model's
    head), called on at most ``slice_rows`` rows at a time; ``k``: top tokens per position.
    One host copy per chunk."""
    n = len(next_token_ids)
    if n == 0:
        return []
    targets = tensor_on(next_token_ids, hidden.device)
    parts = []
    for lo in range(0, n, max(slice_rows, 1)):
        hi = min(lo + max(slice_rows, 1), n)
        logits = compute_logits(hidden[lo:hi]).float()
        parts.append(_score(logits, targets[lo:hi], min(k, MAX_LOGPROBS, logits.shape[-1])))
    chosen, ranks, top_values, top_ids = (torch.cat(t).cpu().tolist() for t in zip(*parts))
    return [[max(chosen[i], FLOOR), [[top_ids[i][j], max(top_values[i][j], FLOOR)] for j in range(len(top_ids[i]))],
             ranks[i]] for i in range(n)]


def _score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """[r, V] logits, [r] target ids -> (target logprob [r], rank [r], top values [r, k], top ids [r, k])."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, targets[:, None])  # [r, 1]
    ranks = (logp > chosen).sum(dim=-1) + 1
    if k:
        top_values, top_ids = logp.topk(k, dim=-1)
    else:
        top_values, top_ids = logp[:, :0], targets[:, None][:, :0]
    return chosen.squeeze(1), ranks, top_values, top_ids
