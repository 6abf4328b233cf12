"""Token sampling: greedy, temperature, top-k, top-p, min_p, per-request seeds.

Sampling is inverse-CDF: each non-greedy row draws one uniform number u and
takes the first token (in descending-probability order) whose cumulative mass
exceeds u. A seeded row draws u on the CPU from a generator seeded with
(seed, step_index) alone, so the token depends only on that row's logits, the
seed and the position of the token in the output: not on the batch it was
sampled in, the device, or which worker (prefill for step 0, decode after)
sampled it. Unseeded rows draw from torch's global CPU RNG.
"""

from __future__ import annotations

import torch

from tandem.cluster.sampling import SamplingParams
from tandem.engine.device_copy import to_device

# Prime multiplier: (seed, step) pairs map to distinct generator seeds in practice.
_SEED_STRIDE = 1_000_003
_MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, params: list[SamplingParams], step_indices: list[int],
           banned: list[list[int]] | None = None) -> list[int]:
    """logits [B, V] fp32; params and step_indices one per row -> B token ids.

    step_indices[b] is the index of the token being generated for row b's
    request (0 for the first token); ``banned`` as in ``sample_async``.
    """
    return sample_async(logits, params, step_indices, banned).tolist()


def sample_async(logits: torch.Tensor, params: list[SamplingParams], step_indices: list[int],
                 banned: list[list[int]] | None = None) -> torch.Tensor:
    """As ``sample``, but -> [B] int64 on the logits' device, without waiting for it.
    ``banned``: per row, token ids it must not pick (min_tokens: its stop and EOS tokens)."""
    num_rows = logits.shape[0]
    if len(params) != num_rows or len(step_indices) != num_rows:
        raise ValueError(f"{num_rows} logits rows but {len(params)} params and {len(step_indices)} step indices")
    if banned is not None and any(banned):
        logits = _ban(logits, banned)
    tokens = logits.argmax(dim=-1)  # [B]; greedy rows keep this
    random_rows = [b for b, p in enumerate(params) if p.temperature != 0]
    if random_rows:
        rows = to_device(torch.tensor(random_rows), logits.device)
        chosen = _sample_rows(
            logits[rows], [params[b] for b in random_rows], [step_indices[b] for b in random_rows]
        )
        tokens = tokens.index_copy(0, rows, chosen)
    return tokens


def _ban(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """A copy of ``logits`` with each row's banned ids at -inf (ids outside the logits, which the
    model cannot produce anyway, are left out rather than indexed)."""
    vocab = logits.shape[-1]
    banned = [[t for t in ids if 0 <= t < vocab] for ids in banned]
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    cols = [t for ids in banned for t in ids]
    logits = logits.clone()
    logits[to_device(torch.tensor(rows), logits.device), to_device(torch.tensor(cols), logits.device)] = float("-inf")
    return logits


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], step_indices: list[int]) -> torch.Tensor:
    """logits [R, V] of non-greedy rows -> [R] int64 token ids."""
    device = logits.device
    temperatures = to_device(torch.tensor([max(p.temperature, _MIN_TEMPERATURE) for p in params]), device)
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
    # stable: among equal probabilities the lower token id comes first, as argmax does
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)  # [R, V]
    keep = _keep_mask(sorted_probs, params)
    sorted_probs = sorted_probs.masked_fill(~keep, 0.0).double()
    cdf = sorted_probs.cumsum(dim=-1)  # [R, V], unnormalised
    uniforms = to_device(_uniforms(params, step_indices), device)  # [R] in [0, 1)
    thresholds = uniforms * cdf[:, -1]
    ranks = torch.searchsorted(cdf, thresholds[:, None], right=True)  # first rank with cdf > u * total
    ranks = ranks.clamp_(max=logits.shape[-1] - 1)
    return sorted_ids.gather(1, ranks).squeeze(1)


def _keep_mask(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[R, V] bool over descending-sorted probabilities: which ranks survive top-k, top-p and min_p."""
    num_rows, vocab = sorted_probs.shape
    device = sorted_probs.device
    top_k = to_device(torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]), device)
    # every token at least as likely as the k-th survives, ties included (as HF's TopKLogitsWarper)
    kth = sorted_probs.gather(1, (top_k - 1)[:, None])  # [R, 1]
    keep = sorted_probs >= kth
    top_p = to_device(torch.tensor([p.top_p for p in params], dtype=sorted_probs.dtype), device)
    # Renormalise over the top-k survivors first (top-k then top-p, as HF/vLLM do).
    kept_probs = sorted_probs.masked_fill(~keep, 0.0)
    kept_probs = kept_probs / kept_probs.sum(dim=-1, keepdim=True)
    mass_before = kept_probs.cumsum(dim=-1) - kept_probs  # mass of strictly better ranks
    # a rank survives while the better ranks hold < top_p: the smallest set with mass >= top_p
    keep &= mass_before < top_p[:, None]
    if any(p.min_p for p in params):
        # min_p: at least min_p times the top probability (HF's MinPLogitsWarper; a ratio that
        # renormalising over the top-k and top-p survivors leaves as it is)
        min_p = to_device(torch.tensor([p.min_p for p in params], dtype=sorted_probs.dtype), device)
        keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True  # always at least the most likely token
    return keep


def _uniforms(params: list[SamplingParams], step_indices: list[int]) -> torch.Tensor:
    """[R] float64 on the CPU: per-(seed, step) generators for seeded rows, global RNG otherwise."""
    uniforms = torch.rand(len(params), dtype=torch.float64)
    for r, (p, step) in enumerate(zip(params, step_indices)):
        if p.seed is not None:
            generator = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + step) % 2**63)
            uniforms[r] = torch.rand((), generator=generator, dtype=torch.float64)
    return uniforms
