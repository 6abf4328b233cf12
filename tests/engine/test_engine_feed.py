"""Decode steps fed from the previous step's tokens on the device (``TokenFeed``):
the same logits as the steps run with every token known on the host; bad feeds
are refused before anything runs. The CUDA-graph path is checked on the GPU in
``tests/engine/test_engine_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.runner import ModelRunner
from tandem.engine.step_tokens import StepTokens, TokenFeed

BLOCK = 4


def _prompts(vocab):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _decode(runner, prompts, blocks, steps, fed, first_seq_inputs=None):
    """Greedy decode -> (logits per step and sequence, the first sequence's input tokens).

    With ``fed`` each step takes its tokens from the previous step's on the device, rows in
    reverse order, except the first sequence's, given on the host from ``first_seq_inputs``
    (the plain run's): nothing waits for the device, so on a GPU the steps queue back to back.
    """
    logits = runner.forward([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])
    tokens = logits.argmax(-1)
    order = [0, 1, 2]  # row i of the previous step holds sequence order[i]
    lengths = [len(p) for p in prompts]
    rows, inputs = [], []
    for step in range(steps):
        new_order = [2, 1, 0] if fed else [0, 1, 2]
        chunks, feed_rows = [], []
        for seq in new_order:
            src = order.index(seq)
            if not fed:
                host, row = int(tokens[src]), -1
            elif seq == 0:
                host, row = first_seq_inputs[step], -1
            else:
                host, row = 0, src  # fed rows carry a dummy token
            if seq == 0:
                inputs.append(host)
            chunks.append(SeqChunk([host], lengths[seq], blocks[seq]))
            feed_rows.append(row)
        if fed and tokens.is_cuda:
            torch.cuda._sleep(2_000_000)  # the device lags the host: staging copies queue behind earlier steps
        feed = TokenFeed(StepTokens(tokens).device_tokens, feed_rows) if fed else None
        logits = runner.forward(chunks, feed)
        rows.append({seq: logits[i].clone() for i, seq in enumerate(new_order)})
        tokens, order = logits.argmax(-1), new_order
        lengths = [n + 1 for n in lengths]
    return rows, inputs


def test_fed_steps_give_the_logits_of_steps_with_every_token_on_the_host(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=BLOCK)
    vocab = runner.config.vocab_size
    prompts = _prompts(vocab)
    plain, inputs = _decode(runner, prompts, [list(range(i * 8, i * 8 + 8)) for i in range(3)], 6, fed=False)
    fed, _ = _decode(runner, prompts, [list(range(24 + i * 8, 32 + i * 8)) for i in range(3)], 6, True, inputs)
    for a, b in zip(plain, fed):
        for seq in range(3):
            torch.testing.assert_close(a[seq], b[seq], rtol=0, atol=1e-5)


def test_a_bad_feed_is_refused_before_anything_runs(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=16, block_size=BLOCK)
    before = runner.kv_pool.kv.clone()
    chunks = [SeqChunk([5], 3, [0]), SeqChunk([6], 2, [1])]
    previous = torch.tensor([9, 10])
    with pytest.raises(ValueError, match="rows"):  # a feed covers the leading rows, never more
        runner.forward(chunks, TokenFeed(previous, [0, 1, 0]))
    with pytest.raises(ValueError, match="outside"):
        runner.forward(chunks, TokenFeed(previous, [0, 2]))
    with pytest.raises(ValueError, match="one new token"):
        runner.forward([SeqChunk([5, 6], 0, [0])], TokenFeed(previous, [0]))
    assert torch.equal(runner.kv_pool.kv, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fed_graph_steps_back_to_back_match_steps_read_one_by_one(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=BLOCK, device="cuda")
    runner.enable_cuda_graphs(max_batch_size=4, max_seq_len=64)
    prompts = _prompts(runner.config.vocab_size)
    assert runner.graphs.can_run([SeqChunk([1], 5, list(range(8)))] * 3)
    plain, inputs = _decode(runner, prompts, [list(range(i * 8, i * 8 + 8)) for i in range(3)], 12, fed=False)
    fed, _ = _decode(runner, prompts, [list(range(24 + i * 8, 32 + i * 8)) for i in range(3)], 12, True, inputs)
    torch.cuda.synchronize()
    for a, b in zip(plain, fed):
        for seq in range(3):
            torch.testing.assert_close(a[seq], b[seq], rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetched_fused_attention_in_fed_graph_steps(tiny_checkpoints, monkeypatch):
    """tandem.kernels.decode_attention.PREFETCH (by default batch 1 only; here every bucket) in CUDA graphs whose steps run back to
    back (the fused form: 3 sequences in bucket 4, one padding row): the logits of the default."""
    from tandem.kernels import decode_attention

    results = []
    for prefetch in (False, True):
        monkeypatch.setattr(decode_attention, "PREFETCH", prefetch)  # read when the graphs are captured
        monkeypatch.setattr(decode_attention, "PREFETCH_MAX_BATCH", 1 << 20)
        runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=BLOCK, device="cuda")
        runner.enable_cuda_graphs(max_batch_size=4, max_seq_len=64)
        prompts = _prompts(runner.config.vocab_size)
        plain, inputs = _decode(runner, prompts, [list(range(i * 8, i * 8 + 8)) for i in range(3)], 12, fed=False)
        fed, _ = _decode(runner, prompts, [list(range(24 + i * 8, 32 + i * 8)) for i in range(3)], 12, True, inputs)
        torch.cuda.synchronize()
        results.append(fed)
    for a, b in zip(*results):
        for seq in range(3):
            torch.testing.assert_close(a[seq], b[seq], rtol=0, atol=1e-4)
