"""Log-probabilities of sampled tokens, for requests that ask (``SamplingParams.logprobs``).

As vLLM's default (raw logprobs), they are the model's own distribution: log-softmax
of the logits before temperature, top-k and top-p. Computed on the device next to
sampling only when a row of the step asks, so a step without them runs exactly as
before; ``entries`` turns the host copies into one wire entry per row::

    [sampled token's logprob, [[token id, logprob], ... the row's k most likely]]

(None for a row that did not ask). ``tandem.engine.step_tokens.StepTokens`` brings the
tensors to the host with the tokens.
"""

from __future__ import annotations

import torch

from tandem.cluster.sampling import MAX_LOGPROBS, SamplingParams

FLOOR = -9999.0


def wanted(params: list[SamplingParams]) -> bool:
    return any(p.logprobs is not None for p in params)


def compute(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """logits [B, V], the sampled tokens [B] int64 -> (sampled logprob [B] fp32, top logprobs
    [B, k] fp32, top ids [B, k] int64) on the logits' device, k the most any row asks for."""
    k = min(max(p.logprobs or 0 for p in params), MAX_LOGPROBS, logits.shape[-1])
    logp = torch.log_softmax(logits.float(), dim=-1)
    sampled = logp.gather(1, tokens[:, None]).squeeze(1)
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], tokens[:, None][:, :0])
    return sampled, top_values, top_ids


def entries(host: tuple[torch.Tensor, ...], params: list[SamplingParams]) -> list[list | None]:
    """``compute``'s tensors (on the host) -> one wire entry per row (None where not asked)."""
    sampled, top_values, top_ids = (t.tolist() for t in host)
    out: list[list | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        k = min(p.logprobs, len(top_ids[row]))
        out.append([_finite(sampled[row]), [[top_ids[row][j], _finite(top_values[row][j])] for j in range(k)]])
    return out


def _finite(logprob: float) -> float:
    """-inf (a masked logit) as -9999.0, as vLLM: JSON has no infinities."""
    return max(logprob, FLOOR)
