"""Steps with prompt chunks replayed as piecewise CUDA graphs (``tandem.engine.mixed_graph``): the
logits and the K/V of the same steps run eagerly, for prompt-only steps, mixed steps with decode
rows fed on the device, and padded buckets; what the graphs cannot run goes eager."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.mixed_graph import token_buckets
from tandem.engine.runner import ModelRunner
from tandem.engine.step_tokens import StepTokens, TokenFeed
from tandem.engine.warmup import warm_up_mixed
from tandem.kernels import decode_attention, ops

BLOCK = 8
BLOCKS_PER_SEQ = 52  # 416 tokens a sequence
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_token_buckets():
    assert token_buckets(2048) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(8192)[7:] == [2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert token_buckets(300) == [256, 300]
    assert token_buckets(256) == [256]


def _steps(runner, base: int, fed: bool):
    """Three steps over sequences whose blocks start at ``base``: prompts alone (240 tokens: bucket
    256, padded), then 3 decode rows + a new prompt's first chunk (300 tokens: bucket 512), then the
    4 decode rows (3 fed when ``fed``) + that prompt's last chunk. -> (logits per step, block ids)."""
    g = torch.Generator().manual_seed(3)
    vocab = runner.config.vocab_size
    blocks = [list(range(base + i * BLOCKS_PER_SEQ, base + (i + 1) * BLOCKS_PER_SEQ)) for i in range(4)]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 70, 130, 400)]
    out = []
    logits = runner.forward([SeqChunk(prompts[i], 0, blocks[i]) for i in range(3)])
    out.append(logits.clone())
    tokens = logits.argmax(-1)
    rows = [SeqChunk([int(tokens[i])], len(prompts[i]), blocks[i]) for i in range(3)]
    logits = runner.forward(rows + [SeqChunk(prompts[3][:297], 0, blocks[3])])
    out.append(logits.clone())
    tokens = logits.argmax(-1)
    rows = [SeqChunk([0 if fed else int(tokens[i])], len(prompts[i]) + 1, blocks[i]) for i in range(3)]
    feed = TokenFeed(StepTokens(tokens).device_tokens, [0, 1, 2]) if fed else None
    logits = runner.forward(rows + [SeqChunk(prompts[3][297:], 297, blocks[3])], feed)
    out.append(logits.clone())
    return out, [b for seq in blocks for b in seq]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("fed", [False, True])
def test_graph_steps_equal_eager_steps(tiny_checkpoints, kv_cache_dtype, fed):
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 KV needs sm89+")
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=8 * BLOCKS_PER_SEQ, block_size=BLOCK, device="cuda",
                         kv_cache_dtype=kv_cache_dtype)
    eager, eager_blocks = _steps(runner, 0, fed)
    runner.enable_mixed_graphs(512)
    assert runner.mixed_graphs.buckets == [256, 512]
    graphed, graph_blocks = _steps(runner, 4 * BLOCKS_PER_SEQ, fed)
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    kv = runner.kv_pool.kv.float()
    # every block the steps wrote holds the same K/V; the padded rows (slot -1) wrote nothing. The
    # GEMMs of a padded bucket may round differently in the last bit, which can move an FP8 code by
    # one step (an eighth of its value, E4M3) where a value sits on a rounding boundary
    tolerance = {"rtol": 0, "atol": 1e-4} if kv_cache_dtype == "auto" else {"rtol": 0.125, "atol": 1e-3}
    torch.testing.assert_close(kv[:, :, eager_blocks], kv[:, :, graph_blocks], **tolerance)


@pytest.mark.gpu
@needs_cuda
def test_what_the_graphs_cannot_run_goes_eager(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=128, block_size=BLOCK, device="cuda")
    runner.enable_mixed_graphs(256)
    assert not runner.mixed_graphs.can_run([SeqChunk(list(range(3, 260)), 0, list(range(33)))])  # > 256 tokens
    assert not runner.mixed_graphs.can_run([SeqChunk([5, 6], 0, [0], lora_slot=0)])  # an adapter row
    logits = runner.forward([SeqChunk(list(range(3, 260)), 0, list(range(33)))])  # eager, same answer as ever
    assert logits.shape == (1, runner.config.vocab_size) and torch.isfinite(logits).all()


def test_mixed_warm_up_runs_through_a_real_runner(tiny_checkpoints, monkeypatch):
    """The steps it builds, one per form of the GPU's decode launch, are ones the runner accepts (on
    the CPU when forced)."""
    monkeypatch.setattr(ops, "decode_attention_variants", decode_attention.decode_attention_variants)
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=24, block_size=16)
    allocator = BlockAllocator(24, 16)
    forms = decode_attention.decode_attention_variants(4, 23, runner.dtype, runner.kv_pool.layer(0)[0])
    assert len(forms) > 1  # 23 blocks of 16: one to three splits
    assert warm_up_mixed(runner, allocator, max_batch_size=4, max_seq_len=360, max_num_tokens=64,
                         force=True) == len(forms)
    assert allocator.num_free == 24
