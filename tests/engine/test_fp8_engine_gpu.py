"""The engine with FP8 weights on CUDA (GPU only): the FP8 GEMV, skinny GEMM and tensor-core path
inside whole forwards, against the same FP8 model on the CPU (the torch references).

- fp32 activations: every FP8 matmul of a chunked, mixed, decoding batch is weight-only (the
  tensor-core path takes bf16 only), so CUDA must match the CPU as the bf16-free engine does
  (test_engine_gpu: ~3e-6 against HF);
- bf16 activations, a 200-token prefill (past 64 rows: x quantized per token, torch._scaled_mm)
  then decode steps through the CUDA graphs at batch 1 and 2: close to the CPU's fp32 logits.
  The CPU with that activation rounding emulated gave cosine >= 0.998 and a largest logit
  difference of 0.16 (of logits up to 2.5) on this model; bf16 adds ~0.05.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_parity import _make_seqs, _run_engine

from tandem.engine.attention import SeqChunk
from tandem.engine.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_cuda_fp32_fp8_matches_the_cpu(tiny_checkpoints, arch):
    logits = {}
    for device in ("cpu", "cuda"):
        runner = ModelRunner(tiny_checkpoints[arch], num_blocks=64, block_size=8, device=device, quantization="fp8")
        assert runner.model.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
        seqs = _make_seqs(runner.config.vocab_size, 64, 8)
        assert _run_engine(runner, seqs) == {"prefill", "mixed", "decode"}
        logits[device] = [{p: row.cpu() for p, row in s.logits.items()} for s in seqs]
    worst = max((logits["cuda"][i][p] - row).abs().max().item()
                for i, rows in enumerate(logits["cpu"]) for p, row in rows.items())
    assert worst <= 1e-3


def test_cuda_bf16_fp8_prefill_on_tensor_cores_and_graph_decode(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    prompt = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks, twin = list(range(16)), list(range(16, 32))
    cuda = ModelRunner(path, num_blocks=64, block_size=16, dtype=torch.bfloat16, device="cuda", quantization="fp8")
    cuda.enable_cuda_graphs(max_batch_size=4, max_seq_len=256)
    cpu = ModelRunner(path, num_blocks=64, block_size=16, quantization="fp8")
    ours = [cuda.forward([SeqChunk(prompt, 0, blocks), SeqChunk(prompt, 0, twin)])[0].float().cpu()]
    ref = [cpu.forward([SeqChunk(prompt, 0, blocks)])[0]]
    tokens = prompt + [int(ref[-1].argmax())]
    for step in range(16):  # batch 2 (the skinny GEMM) for 8 steps, then batch 1 (the GEMV)
        chunks = [SeqChunk([tokens[-1]], len(tokens) - 1, blocks)]
        if step < 8:
            chunks.append(SeqChunk([tokens[-1]], len(tokens) - 1, twin))
        ours.append(cuda.forward(chunks)[0].float().cpu())
        ref.append(cpu.forward([SeqChunk([tokens[-1]], len(tokens) - 1, blocks)])[0])
        tokens.append(int(ref[-1].argmax()))
    ours, ref = torch.stack(ours), torch.stack(ref)
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item() >= 0.99
    assert (ours - ref).abs().max().item() <= 0.5
