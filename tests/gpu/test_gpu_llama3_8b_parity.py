"""The engine's bf16 logits against HF transformers at the llama3-8b shape (GPU only)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@torch.inference_mode()
def test_llama3_8b_bf16_logits_match_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.shapes import SHAPES, hf_config_dict
    from engine.attention import SeqChunk
    from engine.config import ModelConfig
    from engine.loader import model_from_hf_state
    from engine.runner import ModelRunner

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
    blocks = list(range(20))
    # chunked prefill: 128 + 72 tokens
    runner.forward([SeqChunk(prompt[:128], 0, blocks)])
    ours = [runner.forward([SeqChunk(prompt[128:], 128, blocks)])[0]]
    tokens = list(prompt)
    for _ in range(32):
        tokens.append(int(ours[-1].argmax()))
        ours.append(runner.forward([SeqChunk([tokens[-1]], len(tokens) - 1, blocks)])[0])
    ids = torch.tensor([tokens], device="cuda")
    reference = hf(ids).logits[0, len(prompt) - 1 :].float()  # [33, vocab]
    ours = torch.stack(ours)
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    print("cosine min", cosine.min().item(), "mean", cosine.mean().item())
    assert cosine.min().item() >= 0.999
