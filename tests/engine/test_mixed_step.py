"""A mixed step (decode rows first, then prompt chunks, one forward): each row's logits and
the KV it writes equal those of the same rows run in separate forwards; decode rows fed from
the previous step's tokens on the device work in a mixed step too. The same check runs on
the GPU with the Triton kernels (``tests/gpu/test_gpu_cluster.py`` serves through it)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import SeqChunk, build_metadata
from tandem.engine.runner import ModelRunner
from tandem.engine.step_tokens import TokenFeed

BLOCK = 4


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 10, 13, 6)]


def test_metadata_marks_the_decode_rows_of_a_mixed_step():
    meta = build_metadata([SeqChunk([1], 4, [0, 1]), SeqChunk([2], 2, [2]), SeqChunk([3, 4, 5], 0, [3])], BLOCK, "cpu")
    assert (meta.is_decode, meta.is_mixed, meta.num_decode) == (False, True, 2)
    assert meta.prefill_query_start_loc.tolist() == [0, 3]
    plain = build_metadata([SeqChunk([3, 4, 5], 0, [3]), SeqChunk([1], 4, [0, 1])], BLOCK, "cpu")
    assert (plain.is_mixed, plain.num_decode, plain.prefill_query_start_loc) == (False, 0, None)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_mixed_step_equals_its_rows_run_apart(tiny_checkpoints, arch):
    mixed = ModelRunner(tiny_checkpoints[arch], num_blocks=32, block_size=BLOCK)
    apart = ModelRunner(tiny_checkpoints[arch], num_blocks=32, block_size=BLOCK)
    a, b, c, d = _prompts(mixed.config.vocab_size)
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11], "d": [12, 13, 14, 15]}
    for runner in (mixed, apart):  # a and b decode; c has its first chunk in, d none
        runner.forward([SeqChunk(a, 0, blocks["a"]), SeqChunk(b, 0, blocks["b"]), SeqChunk(c[:8], 0, blocks["c"])])
    rows = [SeqChunk([5], len(a), blocks["a"]), SeqChunk([9], len(b), blocks["b"]),
            SeqChunk(c[8:], 8, blocks["c"]), SeqChunk(d, 0, blocks["d"])]
    got = mixed.forward(rows)
    want = torch.cat([apart.forward(rows[:2]), apart.forward(rows[2:3]), apart.forward(rows[3:])])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mixed.kv_pool.kv, apart.kv_pool.kv, rtol=1e-5, atol=1e-5)
    # and the hidden states a scoring prompt reads, in the tokens' order
    logits, hidden = mixed.forward_hidden([SeqChunk([7], len(a) + 1, blocks["a"]), SeqChunk(d[:3], 0, blocks["d"])])
    assert hidden.shape[0] == 4 and logits.shape[0] == 2


def test_fed_decode_rows_in_a_mixed_step(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=32, block_size=BLOCK)
    a, b, c, _ = _prompts(runner.config.vocab_size)
    runner.forward([SeqChunk(a, 0, [0, 1, 2]), SeqChunk(b, 0, [3, 4, 5])])
    previous = torch.tensor([41, 42])  # what a previous step sampled, rows 0 and 1
    fed = runner.forward([SeqChunk([0], len(a), [0, 1, 2]), SeqChunk([8], len(b), [3, 4, 5]),
                          SeqChunk(c, 0, [6, 7, 8, 9])], TokenFeed(previous, [1, -1]))
    again = ModelRunner(tiny_checkpoints["llama"], num_blocks=32, block_size=BLOCK)
    again.forward([SeqChunk(a, 0, [0, 1, 2]), SeqChunk(b, 0, [3, 4, 5])])
    plain = again.forward([SeqChunk([42], len(a), [0, 1, 2]), SeqChunk([8], len(b), [3, 4, 5]),
                           SeqChunk(c, 0, [6, 7, 8, 9])])
    torch.testing.assert_close(fed, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_on_the_gpu_equals_its_rows_run_apart(tiny_checkpoints, dtype):
    """The Triton decode and prefill attention kernels side by side in one forward."""
    runners = [ModelRunner(tiny_checkpoints["llama"], num_blocks=32, block_size=BLOCK, dtype=dtype, device="cuda")
               for _ in range(2)]
    mixed, apart = runners
    a, b, c, d = _prompts(mixed.config.vocab_size)
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11], "d": [12, 13, 14, 15]}
    for runner in runners:
        runner.forward([SeqChunk(a, 0, blocks["a"]), SeqChunk(b, 0, blocks["b"]), SeqChunk(c[:8], 0, blocks["c"])])
    rows = [SeqChunk([5], len(a), blocks["a"]), SeqChunk([9], len(b), blocks["b"]),
            SeqChunk(c[8:], 8, blocks["c"]), SeqChunk(d, 0, blocks["d"])]
    got = mixed.forward(rows)
    want = torch.cat([apart.forward(rows[:2]), apart.forward(rows[2:3]), apart.forward(rows[3:])])
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
