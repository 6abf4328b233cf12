"""logit_bias, the penalties and min_p (engine.logits_process, engine.penalty_slots,
engine.sampler) against HF transformers' own processors on random logits, OpenAI's
presence/frequency formula written out, and the slot buffer's lifecycle."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from tandem.cluster.sampling import SamplingParams
from tandem.engine import sampler
from tandem.engine.logits_process import apply, first_token, plan
from tandem.engine.penalty_slots import PenaltySlots

VOCAB = 96


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def _tokens(n: int, seed: int) -> list[int]:
    """Token ids with repeats (a tenth of the vocabulary), as real text has."""
    return torch.randint(0, VOCAB // 10, (n,), generator=torch.Generator().manual_seed(seed)).mul(7).tolist()


def process(logits, params, prompts=None, outputs=None) -> torch.Tensor:
    """The processed logits, the penalized rows' prompts and outputs in a slot buffer, as a decode
    step sees them."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    slots = PenaltySlots(VOCAB, torch.device("cpu"), capacity=2)
    taken = slots.reset(rows, [prompts[r] for r in rows], [outputs[r] for r in rows]) if rows else []
    return apply(logits, plan(params, VOCAB, logits.device, dict(zip(rows, taken))), slots.counts, slots.prompt)


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties as an HF logits processor: over the tokens
    generated after ``prompt_len``, logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - (self.frequency * counts + self.presence * (counts > 0))


def test_repetition_penalty_equals_hf_over_prompt_and_output():
    penalties = [1.3, 1.0, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    prompts = [_tokens(9, seed=r) for r in range(4)]
    outputs = [_tokens(5, seed=10 + r) for r in range(4)]
    logits = _logits(4)
    before = logits.clone()
    ours = process(logits, params, prompts, outputs)
    assert torch.equal(logits, before)  # the caller's logits (logprobs read them) are untouched
    for r, p in enumerate(penalties):
        input_ids = torch.tensor([prompts[r] + outputs[r]])
        want = RepetitionPenaltyLogitsProcessor(p)(input_ids, logits[r : r + 1].clone())[0]
        assert torch.equal(ours[r], want), r
    assert not torch.equal(ours[0], logits[0])


def test_repetition_penalty_of_a_first_token_looks_at_the_prompt_only():
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(), SamplingParams(repetition_penalty=1.2,
                                                                                       logit_bias=((3, 2.0),))]
    prompts = [_tokens(12, seed=r) for r in range(3)]
    logits = _logits(3, seed=1)
    ours = first_token(logits, params, prompts)
    for r, p in enumerate(params):
        want = logits[r : r + 1].clone()
        if p.logit_bias:
            want = SequenceBiasLogitsProcessor({(3,): 2.0})(torch.tensor([prompts[r]]), want)
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompts[r]]), want)[0]
        assert torch.equal(ours[r], want), r


def test_logit_bias_equals_hf_sequence_bias_of_single_tokens():
    biases = [((5, -100.0), (17, 3.5)), (), ((0, 100.0), (95, -2.25), (40, 0.5))]
    params = [SamplingParams(logit_bias=b) for b in biases]
    logits = _logits(3, seed=2)
    ours = process(logits, params)
    for r, bias in enumerate(biases):
        want = logits[r : r + 1].clone()
        if bias:
            want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(torch.tensor([[1, 2]]), want)
        assert torch.equal(ours[r], want[0]), r
    # an id beyond the logits (a tokenizer larger than the model's head) is left out, not indexed
    assert torch.equal(process(logits, [SamplingParams(logit_bias=((VOCAB + 3, 1.0),))] * 3), logits)


def test_presence_and_frequency_follow_openai_over_the_output_only():
    params = [SamplingParams(frequency_penalty=0.7, presence_penalty=0.4), SamplingParams(),
              SamplingParams(frequency_penalty=-0.5), SamplingParams(presence_penalty=2.0)]
    prompts = [_tokens(10, seed=20 + r) for r in range(4)]
    outputs = [_tokens(12, seed=30 + r) for r in range(4)]
    logits = _logits(4, seed=3)
    ours = process(logits, params, prompts, outputs)
    for r, p in enumerate(params):
        counts = Counter(outputs[r])
        want = logits[r].clone()
        for token, n in counts.items():
            want[token] -= p.frequency_penalty * n + p.presence_penalty
        torch.testing.assert_close(ours[r], want, rtol=0, atol=1e-6)
        # prompt tokens that are not in the output keep their logits
        for token in set(prompts[r]) - set(counts):
            assert ours[r, token] == logits[r, token]


def test_everything_at_once_in_hf_order():
    """logit_bias, then repetition, then presence/frequency: HF's list, the OpenAI processor last."""
    p = SamplingParams(logit_bias=((7, 4.0), (14, -3.0)), repetition_penalty=1.4, frequency_penalty=0.3,
                       presence_penalty=0.6)
    params = [p, SamplingParams(logit_bias=((1, 1.0),)), p]
    prompts = [_tokens(8, seed=40 + r) for r in range(3)]
    outputs = [_tokens(6, seed=50 + r) for r in range(3)]
    logits = _logits(3, seed=4)
    ours = process(logits, params, prompts, outputs)
    for r in (0, 2):
        input_ids = torch.tensor([prompts[r] + outputs[r]])
        want = SequenceBiasLogitsProcessor({(7,): 4.0, (14,): -3.0})(input_ids, logits[r : r + 1].clone())
        want = RepetitionPenaltyLogitsProcessor(1.4)(input_ids, want)
        want = OpenAIPenalties(len(prompts[r]), 0.3, 0.6)(input_ids, want)[0]
        torch.testing.assert_close(ours[r], want, rtol=0, atol=1e-6)
    want = logits[1].clone()
    want[1] += 1.0
    assert torch.equal(ours[1], want)


def test_nothing_asked_returns_the_logits_themselves():
    logits = _logits(2)
    assert plan([SamplingParams(), SamplingParams(temperature=0.0, min_p=0.5)], VOCAB, logits.device) is None
    assert apply(logits, None) is logits
    assert first_token(logits, [SamplingParams()] * 2, [[1], [2]]) is logits


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5), (1.0, 1.0)])
def test_min_p_keeps_the_tokens_hf_min_p_warper_keeps(min_p, temperature):
    logits = _logits(6, seed=5)
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * 6
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    keep = sampler._keep_mask(sorted_probs, params)
    warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    for r in range(6):
        assert set(sorted_ids[r][keep[r]].tolist()) == set(torch.isfinite(warped[r]).nonzero()[:, 0].tolist())


def test_min_p_samples_as_hf_processed_logits_do_and_leaves_greedy_alone():
    row = torch.tensor([[2.0, 1.6, 1.0, 0.2, -1.0, -3.0]])
    temperature, min_p, n = 0.9, 0.3, 20000
    warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, row.clone()))
    want = torch.softmax(warped, dim=-1)[0]
    assert (want == 0).sum() >= 2  # the cut matters here
    params = [SamplingParams(temperature=temperature, min_p=min_p, seed=s) for s in range(n)]
    freq = torch.bincount(torch.tensor(sampler.sample(row.repeat(n, 1), params, [0] * n)), minlength=6).float() / n
    assert torch.all((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-3), (freq, want)
    logits = _logits(4, seed=6)
    assert sampler.sample(logits, [SamplingParams(temperature=0.0, min_p=0.9)] * 4, [0] * 4) == \
        logits.argmax(-1).tolist()


def test_slots_grow_keep_their_contents_and_are_reused_clean():
    slots = PenaltySlots(VOCAB, torch.device("cpu"), capacity=2)
    assert slots.capacity == 2 and slots.num_used == 0
    keys = [f"r{i}" for i in range(5)]
    prompts = [_tokens(4, seed=60 + i) for i in range(5)]
    outputs = [[], [3], [3, 3, 9], _tokens(7, seed=70), [VOCAB - 1] * 4]  # a resumed request brings its output
    taken = slots.reset(keys[:2], prompts[:2], outputs[:2])
    taken += slots.reset(keys[2:], prompts[2:], outputs[2:])  # full: doubled, twice
    assert slots.capacity == 8 and slots.num_used == 5 and len(set(taken)) == 5
    for key, slot, prompt, output in zip(keys, taken, prompts, outputs):
        assert slots.slot(key) == slot and slots.counted(key) == len(output)
        assert slots.counts[slot].tolist() == [float(Counter(output)[t]) for t in range(VOCAB)]
        assert set(slots.prompt[slot].nonzero()[:, 0].tolist()) == set(prompt)
    # a step's tokens counted on the device, one per key
    slots.count(keys[1:3], torch.tensor(taken[1:3]), torch.tensor([3, 50]))
    assert slots.counts[taken[1], 3] == 2 and slots.counts[taken[2], 50] == 1
    assert slots.counted("r1") == 2 and slots.counted("r2") == 4
    slots.release(["r1", "r3", "never-here"])
    assert slots.num_used == 3 and slots.slot("r1") is None and slots.counted("r1") is None
    (again,) = slots.reset(["new"], [[5]], [[]])
    assert again in (taken[1], taken[3])  # a freed slot, filled afresh
    assert slots.counts[again].sum() == 0 and slots.prompt[again].nonzero()[:, 0].tolist() == [5]
    (refilled,) = slots.reset(["r2"], [prompts[2]], [[1]])  # a key that holds a slot keeps it
    assert refilled == taken[2] and slots.counts[refilled].sum() == 1 and slots.counted("r2") == 1


def test_processing_and_counting_never_read_the_device(monkeypatch):
    """No .item(), .tolist(), .cpu() or truth test of a tensor: each would make the host wait for
    the device, and the decode loop launches the next step first."""
    slots = PenaltySlots(VOCAB, torch.device("cpu"), capacity=1)
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias=((2, 1.0),)),
              SamplingParams(presence_penalty=0.5)]
    logits = _logits(2)

    def refuse(*_args, **_kwargs):
        raise AssertionError("a host sync")

    for name in ("item", "tolist", "cpu", "__bool__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    taken = slots.reset(["a", "b"], [[1, 2, 3], [4]], [[5, 5], []])  # grows once
    step = plan(params, VOCAB, logits.device, dict(enumerate(taken)))
    out = apply(logits, step, slots.counts, slots.prompt)
    slots.count(["a", "b"], step.penalties[0][1], out.argmax(-1))
    first_token(logits, params, [[1, 2], [3]])
    monkeypatch.undo()
    assert slots.counted("a") == 3 and slots.counts[taken].sum() == 4
