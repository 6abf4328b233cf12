"""Logprobs of sampled tokens (engine.logprobs): the model's own log-softmax, computed only
when a row asks, carried to the host with the step's tokens, and published by the decode
loop on each token's event."""

import torch

from tandem.cluster.sampling import SamplingParams
from tandem.engine import logprobs
from tandem.engine.step_tokens import StepTokens
from tests.unit.test_decode_loop import _running, _turn, _worker


def test_entries_are_the_log_softmax_of_the_logits_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=0.0, logprobs=0)]
    assert logprobs.wanted(params) and not logprobs.wanted([SamplingParams()])
    tokens = torch.tensor([4, 9, 17])
    entries = logprobs.entries(logprobs.compute(logits, tokens, params), params)
    reference = torch.log_softmax(logits, dim=-1)  # raw: temperature and top-k/p do not change them
    sampled, top = entries[0]
    assert abs(sampled - reference[0, 4].item()) < 1e-5
    values, ids = reference[0].topk(3)
    assert [i for i, _ in top] == ids.tolist()
    assert all(abs(lp - v) < 1e-5 for (_, lp), v in zip(top, values.tolist()))
    assert entries[1] is None  # did not ask
    assert entries[2][1] == [] and abs(entries[2][0] - reference[2, 17].item()) < 1e-5


def test_top_logprobs_are_capped_by_the_vocabulary_and_never_infinite():
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]])
    params = [SamplingParams(logprobs=20)]
    (entry,) = logprobs.entries(logprobs.compute(logits, torch.tensor([2]), params), params)
    assert len(entry[1]) == 4
    assert entry[0] == logprobs.FLOOR and entry[1][-1] == [2, logprobs.FLOOR]  # JSON has no -inf


def test_step_tokens_carry_extra_tensors_to_the_host():
    extra = (torch.tensor([-0.5]), torch.zeros(1, 0), torch.zeros(1, 0, dtype=torch.long))
    step = StepTokens(torch.tensor([3]), extra)
    assert step.wait() == [3] and step.extra() is not None and step.extra()[0].item() == -0.5
    assert StepTokens(torch.tensor([3])).extra() is None


def test_the_decode_loop_publishes_each_tokens_logprobs():
    worker = _worker()
    asking = _running(worker, "r1", max_tokens=3)
    asking.spec.sampling = SamplingParams(temperature=0.0, logprobs=1)
    _running(worker, "r2", max_tokens=3)  # in the same steps, asking for none
    for _ in range(4):
        _turn(worker)
    # the fake runner's logits: 1.0 at token 7, 0.0 elsewhere (10 tokens)
    expected = torch.log_softmax(torch.zeros(10).index_fill_(0, torch.tensor([7]), 1.0), 0)[7].item()
    mine = [e for e in worker.redis.events if e.request_id == "r1"]
    assert [e.token_ids for e in mine] == [[7], [7]]
    for event in mine:
        ((sampled, top),) = event.logprobs
        assert abs(sampled - expected) < 1e-6 and top[0][0] == 7 and abs(top[0][1] - expected) < 1e-6
    assert all(e.logprobs is None for e in worker.redis.events if e.request_id == "r2")
