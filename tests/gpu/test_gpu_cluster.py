"""The whole cluster on one GPU (cuda_ipc handoff, CUDA graphs) against HF generate (GPU only)."""

import asyncio

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("layout", ["separate", "colocated"])
def test_gpu_cluster_greedy_matches_hf(tmp_path, layout):
    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.demo_model import make_tiny_checkpoint
    from tests.e2e.cluster import LocalCluster

    path = make_tiny_checkpoint(tmp_path / "m", "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=32)
    cluster = LocalCluster(path, str(tmp_path), layout, device="cuda", dtype="float32", tokens_per_block=16,
                           max_num_tokens=32, max_seq_len=256, max_input_len=200,
                           max_tokens_in_paged_kv_cache=8192).start()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = ["Hello world!", "Once upon a time there was a small model that lived in a test directory. " * 2,
                   "The quick brown fox", "one, two, three, four, five, six, seven, eight, nine, ten."]

        async def one(client, prompt):
            r = await client.post("/v1/completions", json={"model": cluster.settings.model_name, "prompt": prompt,
                                                           "max_tokens": 24, "temperature": 0,
                                                           "return_token_ids": True})
            return r.json()["choices"][0]["token_ids"]

        async def run():
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        outputs = asyncio.run(run())
        for prompt, got in zip(prompts, outputs):
            ids = tokenizer(prompt).input_ids
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
            assert got == ref, prompt
        cluster.wait_blocks_free("decode", "decode-0")
    finally:
        cluster.stop()
