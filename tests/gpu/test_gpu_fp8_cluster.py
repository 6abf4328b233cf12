"""The whole cluster on one GPU with FP8 weights and an FP8 KV cache (cuda_ipc handoff of FP8
blocks, CUDA graphs): every request of a concurrent mix, short and long, chunked and not,
guided and not, is served without error (GPU only)."""

import asyncio
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("layout", ["separate", "colocated"])
def test_gpu_cluster_in_fp8_serves_every_request(tmp_path, layout):
    import httpx

    from tandem.engine.demo_model import make_tiny_checkpoint
    from tests.e2e.cluster import LocalCluster

    path = make_tiny_checkpoint(tmp_path / "m", "llama", hidden_size=128, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    cluster = LocalCluster(path, str(tmp_path), layout, device="cuda", dtype="bfloat16", quantization="fp8",
                           kv_cache_dtype="fp8", tokens_per_block=16, max_num_tokens=64, max_seq_len=512,
                           max_input_len=400, max_tokens_in_paged_kv_cache=8192).start()
    try:
        info = cluster.worker("decode", "decode-0")
        assert info is not None and info.num_total_blocks == 2 * 8192 // 16  # one byte an element: twice the tokens
        prompts = ["Hello world!", "Once upon a time there was a small model. " * 12, "The quick brown fox",
                   "one, two, three, four, five, six, seven, eight, nine, ten. " * 5]

        async def one(client, i):
            body = {"model": cluster.settings.model_name, "prompt": prompts[i % 4], "max_tokens": 48,
                    "temperature": 0 if i % 3 else 1.0, "seed": i, "ignore_eos": True}
            if i % 5 == 0:
                body["structured_outputs"] = {"json": {"type": "array", "minItems": 2, "maxItems": 4,
                                                       "items": {"type": "integer", "minimum": 0, "maximum": 99}}}
                body.pop("ignore_eos")
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length"), choice
            if i % 5 == 0:
                assert isinstance(json.loads(choice["text"]), list)
            else:
                assert r.json()["usage"]["completion_tokens"] == 48
            return choice

        async def run():
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
                return await asyncio.gather(*(one(client, i) for i in range(24)))

        assert len(asyncio.run(run())) == 24
        cluster.wait_blocks_free("decode", "decode-0")
    finally:
        cluster.stop()
