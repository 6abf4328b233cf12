"""Prompt logprobs computed chunk by chunk, in slices of rows, equal a full log-softmax over the prompt."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.logprobs import FLOOR
from tandem.engine.prompt_logprobs import chunk_entries, num_scored, rows_per_slice
from tandem.engine.runner import ModelRunner


def _reference(logits: torch.Tensor, prompt: list[int], k: int) -> list:
    """Entries from one log-softmax over every position's logits [P, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = [None]
    for i in range(len(prompt) - 1):
        row, target = logp[i], prompt[i + 1]
        values, ids = row.topk(k)
        rank = int((row > row[target]).sum()) + 1
        out.append([max(row[target].item(), FLOOR), [[int(t), max(v.item(), FLOOR)] for v, t in zip(values, ids)], rank])
    return out


def _assert_close(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert abs(g[0] - w[0]) < 1e-5 and g[2] == w[2]
        assert [t for t, _ in g[1]] == [t for t, _ in w[1]]
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(g[1], w[1]))


def _by_chunks(hidden: torch.Tensor, head, prompt: list[int], chunk: int, k: int, slice_rows: int) -> list:
    entries = [None]
    for start in range(0, len(prompt), chunk):
        n = num_scored(start, min(chunk, len(prompt) - start), len(prompt))
        entries += chunk_entries(head, hidden[start : start + n], prompt[start + 1 : start + 1 + n], k, slice_rows)
    return entries


@pytest.mark.parametrize("chunk, slice_rows", [(4, 1), (5, 2), (16, 3), (64, 64)])
def test_chunks_and_slices_equal_one_log_softmax(chunk, slice_rows):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen)
    hidden = torch.randn(23, 8, generator=gen)
    prompt = torch.randint(0, 50, (23,), generator=gen).tolist()
    calls = []

    def head(h):
        calls.append(h.shape[0])
        return h @ weight.T

    got = _by_chunks(hidden, head, prompt, chunk, 5, slice_rows)
    _assert_close(got, _reference(hidden @ weight.T, prompt, 5))
    assert max(calls) <= slice_rows  # never more rows of full-vocabulary logits at once


def test_masked_logits_are_floored_and_k_zero_keeps_the_token_only():
    logits = torch.tensor([[0.0, float("-inf"), 1.0], [2.0, 0.0, float("-inf")]])
    got = chunk_entries(lambda h: h, logits, [1, 2], 0, 8)
    assert got[0][0] == FLOOR and got[0][1] == [] and got[0][2] == 3
    assert got[1][0] == FLOOR and got[1][2] == 3
    top = chunk_entries(lambda h: h, logits, [2, 0], 3, 1)
    assert [t for t, _ in top[0][1]] == [2, 0, 1] and top[0][1][2][1] == FLOOR and top[0][2] == 1


def test_the_last_position_scores_nothing_and_slices_fit_the_vocabulary():
    assert num_scored(0, 4, 4) == 3 and num_scored(4, 4, 8) == 3 and num_scored(0, 4, 9) == 4
    assert num_scored(0, 1, 1) == 0
    assert rows_per_slice(1 << 30) == 1 and rows_per_slice(1 << 10) == 1 << 14


def test_runner_chunks_equal_the_whole_prompt_in_one_forward(tiny_checkpoints):
    """The runner's hidden states of a prompt run in 16-token chunks score it as one forward does."""
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=32, block_size=4)
    prompt = torch.randint(3, runner.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = list(range(10))
    whole_logits, whole_hidden = runner.forward_hidden([SeqChunk(prompt, 0, blocks)])
    assert torch.allclose(whole_logits[0], runner.compute_logits(whole_hidden[-1:])[0])
    want = _reference(runner.compute_logits(whole_hidden), prompt, 4)
    got = [None]
    for start in range(0, len(prompt), 16):
        tokens = prompt[start : start + 16]
        _, hidden = runner.forward_hidden([SeqChunk(tokens, start, blocks)])
        n = num_scored(start, len(tokens), len(prompt))
        got += chunk_entries(runner.compute_logits, hidden[:n], prompt[start + 1 : start + 1 + n], 4, 3)
    _assert_close(got, want)
