"""The nccl transport (gloo on the CPU) under the real workers: greedy output
through gateway, decode and prefill equals HF generate() token for token."""

import httpx
import pytest
import torch

from tandem.engine.demo_model import make_tiny_checkpoint
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world!", "A serving system reads the prompt, computes the keys and values of every "
           "token, then writes one new token at a time until the answer is complete."]
MAX_TOKENS = 12


def _hf_greedy(checkpoint, prompt_ids, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def test_cluster_serves_through_the_nccl_transport(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-llama", "llama")
    # small blocks and chunks: the long prompt crosses several chunks and blocks
    cluster = LocalCluster(checkpoint, str(tmp_path), tokens_per_block=4, max_num_tokens=16, max_seq_len=256,
                           max_input_len=200, kv_transport="nccl").start()
    try:
        assert cluster.worker("decode", "decode-0").kv_endpoint["backend"] == "gloo"
        outputs = []
        for prompt in PROMPTS:
            body = {"model": cluster.settings.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "return_token_ids": True}
            resp = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            outputs.append((choice["prompt_token_ids"], choice["token_ids"]))
    finally:
        cluster.stop()
    assert len(outputs[1][0]) > 16  # more than one chunk
    for prompt_ids, token_ids in outputs:
        assert token_ids == _hf_greedy(checkpoint, prompt_ids, len(token_ids))
