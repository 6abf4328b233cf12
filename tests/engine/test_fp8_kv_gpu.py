"""The engine with an FP8 KV cache on CUDA (Triton kernels, CUDA graphs) against the same engine
on the CPU (the torch references): the same scales, then the same logits along the same tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.runner import ModelRunner
from test_engine_parity import CHUNK_SIZE, _make_seqs, _run_engine
from tandem.kernels import switches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _replay(runner: ModelRunner, seqs) -> float:
    """The schedule _run_engine ran (prompt chunks of CHUNK_SIZE, then one token a step), its tokens
    fixed (teacher forcing): -> the largest difference from the logits it recorded."""
    worst, step = 0.0, 0
    seqs = copy.deepcopy(seqs)
    for seq in seqs:
        seq.num_computed = 0
    while any(s.num_computed < len(s.tokens) - 1 for s in seqs):
        active = [s for s in seqs if s.start_step <= step and s.num_computed < len(s.tokens) - 1]
        chunks = [SeqChunk(s.tokens[s.num_computed:s.num_computed + (
            min(CHUNK_SIZE, s.prompt_len - s.num_computed) if s.num_computed < s.prompt_len else 1)],
            s.num_computed, s.block_ids) for s in active]
        for seq, chunk, row in zip(active, chunks, runner.forward(chunks).cpu()):
            seq.num_computed += len(chunk.token_ids)
            if seq.num_computed - 1 in seq.logits:
                worst = max(worst, (row - seq.logits[seq.num_computed - 1].cpu()).abs().max().item())
        step += 1
    return worst


@pytest.mark.parametrize("fused_rotary", ["0", "1"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_cuda_fp8_kv_matches_the_cpu_references(tiny_checkpoints, arch, fused_rotary, monkeypatch):
    monkeypatch.setenv("TANDEM_FUSED_ROTARY", fused_rotary)
    switches.reload()
    gpu = ModelRunner(tiny_checkpoints[arch], num_blocks=64, block_size=8, device="cuda", kv_cache_dtype="fp8")
    cpu = ModelRunner(tiny_checkpoints[arch], num_blocks=64, block_size=8, kv_cache_dtype="fp8")
    assert gpu.kv_pool.kv.dtype == torch.float8_e4m3fn and gpu.kv_pool.kv.is_cuda
    assert gpu.kv_pool.kv_format() == cpu.kv_pool.kv_format()  # calibrated alike on both devices
    seqs = _make_seqs(gpu.config.vocab_size, 64, 8)
    assert _run_engine(gpu, seqs) == {"prefill", "mixed", "decode"}
    worst = _replay(cpu, seqs)
    print(f"largest logit difference, CUDA FP8 cache vs CPU FP8 cache: {worst:.2e}")
    assert worst <= 2e-2  # an fp32 model: the same codes but where a value sits on a rounding boundary


def test_cuda_graphs_with_an_fp8_kv_cache(tiny_checkpoints):
    """Decode steps replayed from CUDA graphs read and write the FP8 pool as eager steps do."""
    eager = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=8, device="cuda", kv_cache_dtype="fp8")
    graphed = ModelRunner(tiny_checkpoints["llama"], num_blocks=64, block_size=8, device="cuda",
                          kv_cache_dtype="fp8")
    graphed.enable_cuda_graphs(max_batch_size=8, max_seq_len=256)
    seqs = _make_seqs(eager.config.vocab_size, 64, 8)
    _run_engine(eager, seqs)
    worst = _replay(graphed, seqs)
    print(f"largest logit difference, graphs vs eager: {worst:.2e}")
    assert worst <= 1e-3


def test_a_bf16_model_with_an_fp8_cache_stays_close_to_its_bf16_cache(tiny_checkpoints):
    runners = {dtype: ModelRunner(tiny_checkpoints["mistral"], num_blocks=64, block_size=16, dtype=torch.bfloat16,
                                  device="cuda", kv_cache_dtype=dtype) for dtype in ("auto", "fp8")}
    seqs = _make_seqs(runners["auto"].config.vocab_size, 64, 16)
    _run_engine(runners["auto"], seqs)
    worst = _replay(runners["fp8"], seqs)
    print(f"largest logit difference, bf16 model: FP8 cache vs bf16 cache: {worst:.2e}")
    assert worst <= 0.6  # the same comparison on the CPU (the references): 0.29 (2026-12-02)
