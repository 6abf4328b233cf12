"""The engine on CUDA (Triton kernels through kernels.ops) against HF on the CPU."""

from __future__ import annotations

import pytest
import torch

from tandem.cluster.sampling import SamplingParams
from tandem.engine.runner import ModelRunner
from tandem.engine.sampler import sample
from test_engine_parity import _hf, _make_seqs, _max_diff_vs_hf, _run_engine
from tandem.kernels import switches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# decode rotary + KV write in their own kernel / in attention / fused for batches up to 8
@pytest.mark.parametrize("fused_rotary", ["0", "1", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_cuda_fp32_matches_hf(tiny_checkpoints, arch, fused_rotary, monkeypatch):
    monkeypatch.setenv("TANDEM_FUSED_ROTARY", fused_rotary)
    switches.reload()
    runner = ModelRunner(tiny_checkpoints[arch], num_blocks=64, block_size=8, device="cuda")
    assert runner.kv_pool.kv.is_cuda and runner.cos_sin_cache.is_cuda
    seqs = _make_seqs(runner.config.vocab_size, 64, 8)
    assert _run_engine(runner, seqs) == {"prefill", "mixed", "decode"}
    for seq in seqs:
        seq.logits = {pos: row.cpu() for pos, row in seq.logits.items()}
    # measured ~3e-6 on an H200 (torch 2.11, Triton 3.6); headroom for other GPUs' reduction orders
    assert _max_diff_vs_hf(_hf(tiny_checkpoints[arch]), seqs) <= 1e-3


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_cuda_fp32_matches_hf_with_the_prefetched_fused_form(tiny_checkpoints, arch, monkeypatch):
    """tandem.kernels.decode_attention.PREFETCH at every batch size (by default batch 1 only): the fused
    decode attention loads its last tile before the PDL wait and takes the new token's k, v
    from registers."""
    from tandem.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "PREFETCH", True)
    monkeypatch.setattr(decode_attention, "PREFETCH_MAX_BATCH", 1 << 20)
    test_cuda_fp32_matches_hf(tiny_checkpoints, arch, "1", monkeypatch)


def test_cuda_bf16_runs_close_to_hf(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["mistral"], num_blocks=64, block_size=16, dtype=torch.bfloat16,
                         device="cuda")
    seqs = _make_seqs(runner.config.vocab_size, 64, 16)
    _run_engine(runner, seqs)
    for seq in seqs:
        seq.logits = {pos: row.cpu() for pos, row in seq.logits.items()}
    assert _max_diff_vs_hf(_hf(tiny_checkpoints["mistral"]), seqs) <= 0.15  # measured ~0.05


def test_seeded_sampling_same_on_cuda_and_cpu():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=s) for s in range(5)] + [
        SamplingParams(temperature=0.0)
    ]
    steps = [0, 1, 2, 3, 4, 5]
    assert sample(logits.cuda(), params, steps) == sample(logits, params, steps)
