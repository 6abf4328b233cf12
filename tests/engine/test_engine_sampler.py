from __future__ import annotations

import math

import pytest
import torch

from tandem.cluster.sampling import SamplingParams
from tandem.engine.sampler import sample

GREEDY = SamplingParams(temperature=0.0)


def _logits(batch: int = 4, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(8)
    assert sample(logits, [GREEDY] * 8, [0] * 8) == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _logits(6)
    want = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 6, list(range(6))) == want
    assert sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 6, list(range(6))) == want


def test_seeded_rows_do_not_depend_on_batch_composition():
    logits = _logits(5)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9, 10, 11)]
    steps = [0, 3, 5, 1, 2]
    full = sample(logits, params, steps)
    # alone, in another order, and next to greedy and unseeded rows
    for b in range(5):
        assert sample(logits[b : b + 1], [params[b]], [steps[b]]) == [full[b]]
    order = [4, 2, 0, 3, 1]
    assert sample(logits[order], [params[i] for i in order], [steps[i] for i in order]) == [full[i] for i in order]
    mixed = torch.cat([logits[:1], _logits(1, seed=5), logits[3:4]])
    out = sample(mixed, [params[0], SamplingParams(), params[3]], [steps[0], 9, steps[3]])
    assert (out[0], out[2]) == (full[0], full[3])


def test_seed_and_step_index_both_change_the_draw():
    logits = torch.zeros(1, 1000)  # uniform: draws differ unless the uniforms coincide
    p = SamplingParams(seed=42)
    by_step = {sample(logits, [p], [step])[0] for step in range(20)}
    by_seed = {sample(logits, [SamplingParams(seed=s)], [0])[0] for s in range(20)}
    assert len(by_step) > 15 and len(by_seed) > 15
    assert sample(logits, [p], [3]) == sample(logits, [p], [3])


def test_distribution_matches_softmax_with_temperature():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().repeat(n, 1)
    for temperature in (1.0, 0.5):
        want = torch.softmax(probs.log() / temperature, -1)
        tokens = torch.tensor(sample(logits, [SamplingParams(temperature=temperature)] * n, [0] * n))
        freq = torch.bincount(tokens, minlength=4).float() / n
        # 5 standard errors of a binomial proportion
        assert torch.all((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-3), (freq, want)


def test_top_k_and_top_p_restrict_the_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().repeat(n, 1)
    top2 = sample(logits, [SamplingParams(top_k=2, seed=i) for i in range(n)], [0] * n)
    assert set(top2) == {0, 1}
    # the smallest set with mass >= 0.6 is {0, 1}; mass >= 0.81 needs {0, 1, 2}
    assert set(sample(logits, [SamplingParams(top_p=0.6)] * n, [0] * n)) == {0, 1}
    assert set(sample(logits, [SamplingParams(top_p=0.81)] * n, [0] * n)) == {0, 1, 2}
    # top-k first, then top-p over the renormalised survivors: 0.5/0.8 = 0.625 < 0.7 keeps both
    assert set(sample(logits, [SamplingParams(top_k=2, top_p=0.7)] * n, [0] * n)) == {0, 1}
    assert set(sample(logits, [SamplingParams(top_k=3, top_p=0.5)] * n, [0] * n)) == {0}


def test_never_samples_masked_tokens():
    logits = torch.full((2000, 10), -math.inf)
    logits[:, 3] = 0.0
    logits[:, 7] = 0.0
    tokens = sample(logits, [SamplingParams(temperature=2.0)] * 2000, [0] * 2000)
    assert set(tokens) == {3, 7}


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError):
        sample(_logits(2), [GREEDY], [0, 0])


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 2, 1.0), (0.7, 2, 0.9), (1.3, 3, 0.5)])
def test_tied_logits_at_the_top_k_cut_are_kept_as_hf_does(temperature, top_k, top_p):
    """HF's TopKLogitsWarper keeps every token tied with the k-th; so do we (not only the lowest
    ids). Which of the tied tokens a top-p cut then keeps is an arbitrary order in both (HF keeps
    the highest ids, we the lowest): compared as groups, [0], the tied [1, 2, 3], [4]."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    row = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    scores = TemperatureLogitsWarper(temperature)(None, row.clone())
    scores = TopKLogitsWarper(top_k)(None, scores)
    want = torch.softmax(TopPLogitsWarper(top_p)(None, scores), -1)[0]
    n = 20000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=i) for i in range(n)]
    freq = torch.bincount(torch.tensor(sample(row.repeat(n, 1), params, [0] * n)), minlength=5).float() / n
    groups = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.float32)
    got, want = groups @ freq, groups @ want
    assert torch.all((got - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-3), (freq, want)
    if top_p == 1.0:  # no top-p cut: the tied tokens are equally likely, as in HF
        assert (freq[1:4] - freq[1:4].mean()).abs().max() < 0.02 and freq[1:4].min() > 0.05


def test_banned_tokens_are_never_picked_greedy_or_sampled():
    """min_tokens: a row's banned ids (its stop and EOS tokens) are out of the running; other rows
    and the caller's logits are untouched."""
    from tandem.cluster.request_state import banned_token_ids, finish_reason

    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    assert sample(logits, params, [0, 0], banned=[[1], []]) == [2, 1]
    assert torch.equal(logits, before)
    sampled = sample(logits.repeat(50, 1), [SamplingParams(temperature=5.0, seed=s) for s in range(100)],
                     [0] * 100, banned=[[1, 2]] * 100)
    assert set(sampled) <= {0, 3}
    # an id the logits do not have (a stop token beyond the model's vocabulary): ignored, no crash
    assert sample(logits, params, [0, 0], banned=[[1, 4, -1], [9]]) == [2, 1]
    spec = SamplingParams(min_tokens=2)
    assert banned_token_ids(spec, 1, [3], [2], ignore_eos=False) == [3, 2]
    assert banned_token_ids(spec, 1, [3], [2], ignore_eos=True) == [3]
    assert banned_token_ids(spec, 2, [3], [2], ignore_eos=False) == []
    kwargs = dict(max_tokens=10, max_seq_len=100, stop_token_ids=[3], eos_token_ids=[2], ignore_eos=False)
    assert finish_reason(2, 2, 5, min_tokens=2, **kwargs) is None  # the 2nd token cannot stop yet
    assert finish_reason(2, 3, 6, min_tokens=2, **kwargs) == "stop"
