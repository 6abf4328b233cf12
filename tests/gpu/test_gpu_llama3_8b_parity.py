"""The engine's bf16 logits against HF transformers at the llama3-8b shape (GPU only).

Same random weights in both. The truth is HF in fp32; the engine in bf16 must
reach cosine similarity >= 0.999 with it on the final logits of the prefill
and of 32 decode steps, or, where HF's own bf16 forward is further than that
from its fp32 forward (random weights leave little signal in the logits),
come within 1e-3 of HF bf16's own similarity.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@torch.inference_mode()
def test_llama3_8b_bf16_logits_match_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.bench.shapes import SHAPES, hf_config_dict
    from tandem.engine.attention import SeqChunk
    from tandem.engine.config import ModelConfig
    from tandem.engine.loader import model_from_hf_state
    from tandem.engine.runner import ModelRunner

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = LlamaForCausalLM(LlamaConfig(**SHAPES["llama3-8b"], rms_norm_eps=1e-5)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    config = ModelConfig.from_dict(hf_config_dict("llama3-8b"))
    model = model_from_hf_state(config, hf.state_dict(), torch.bfloat16, "cuda")
    runner = ModelRunner.from_model(model, config, num_blocks=64, block_size=16)
    runner.enable_cuda_graphs(max_batch_size=4, max_seq_len=1024)

    prompt = torch.randint(3, config.vocab_size, (200,)).tolist()
    # the same sequence twice, in two sets of blocks, so that decode runs as a batch of 2 (the
    # skinny GEMM with its add-norm finish) as well as 1 (the GEMV, second half of the steps)
    blocks, twin = list(range(20)), list(range(20, 40))
    runner.forward([SeqChunk(prompt[:128], 0, blocks), SeqChunk(prompt[:128], 0, twin)])  # chunked: 128 + 72
    first = runner.forward([SeqChunk(prompt[128:], 128, blocks), SeqChunk(prompt[128:], 128, twin)])
    ours, twins = [first[0]], [first[1]]
    tokens = list(prompt)
    for step in range(32):  # decode steps through the CUDA graphs
        tokens.append(int(ours[-1].argmax()))
        chunks = [SeqChunk([tokens[-1]], len(tokens) - 1, blocks)]
        if step < 16:
            chunks.append(SeqChunk([tokens[-1]], len(tokens) - 1, twin))
        logits = runner.forward(chunks)
        ours.append(logits[0])
        if step < 16:
            twins.append(logits[1])
    ours = torch.stack(ours)  # [33, vocab]
    twin_cos = torch.nn.functional.cosine_similarity(torch.stack(twins), ours[:len(twins)], dim=-1)
    assert twin_cos.min().item() >= 0.9999  # rows of a batch do not mix
    ids = torch.tensor([tokens], device="cuda")
    start = len(prompt) - 1
    hf_bf16 = hf(ids).logits[0, start:].float()
    del model, runner
    hf_fp32 = hf.float()(ids).logits[0, start:]

    def cos(a, b):
        return torch.nn.functional.cosine_similarity(a, b, dim=-1)

    ours_vs_truth, hf_vs_truth, ours_vs_hf = cos(ours, hf_fp32), cos(hf_bf16, hf_fp32), cos(ours, hf_bf16)
    print(f"cosine vs HF fp32: ours min {ours_vs_truth.min():.5f} mean {ours_vs_truth.mean():.5f}; "
          f"HF bf16 min {hf_vs_truth.min():.5f} mean {hf_vs_truth.mean():.5f}; "
          f"ours vs HF bf16 min {ours_vs_hf.min():.5f}")
    assert ours_vs_truth.min().item() >= min(0.999, hf_vs_truth.min().item() - 1e-3)
