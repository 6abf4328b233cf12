"""Structured outputs on the GPU: the bitmask applied on the device equals the CPU's, and a GPU
cluster (CUDA graphs, steps run ahead) serves guided requests whose every output obeys its
schema, beside unguided ones (GPU only)."""

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bitmask_on_the_device_equals_the_host():
    from tandem.engine.guide import apply_bitmask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 1000, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (7, 32), generator=g, dtype=torch.int64).to(torch.int32)
    host = apply_bitmask(logits, bitmask)
    device = apply_bitmask(logits.cuda(), bitmask).cpu()
    assert torch.equal(torch.isinf(host), torch.isinf(device))
    assert torch.equal(host[torch.isfinite(host)], device[torch.isfinite(device)])
    bits = [(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for r in range(7) for t in range(1000)]
    assert torch.isfinite(host).flatten().tolist() == [bool(b) for b in bits]


@pytest.mark.parametrize("layout", ["separate", "colocated"])
def test_gpu_cluster_guided_and_plain_requests(tmp_path, layout):
    import asyncio

    import httpx
    import jsonschema

    from tandem.engine.demo_model import make_tiny_checkpoint
    from tests.e2e.cluster import LocalCluster

    path = make_tiny_checkpoint(tmp_path / "m", "llama", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=32)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    cluster = LocalCluster(path, str(tmp_path), layout, device="cuda", dtype="float32", tokens_per_block=16,
                           max_num_tokens=32, max_seq_len=256, max_input_len=200,
                           max_tokens_in_paged_kv_cache=8192).start()
    try:
        async def one(client, i):
            body = {"model": cluster.settings.model_name, "prompt": f"request {i}", "max_tokens": 64,
                    "temperature": 1.0, "seed": i}
            if i % 2 == 0:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return i, r.json()["choices"][0]

        async def run():
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(16)))

        for i, choice in asyncio.run(run()):
            if i % 2 == 0:
                assert choice["finish_reason"] == "stop", choice
                jsonschema.validate(json.loads(choice["text"]), schema)
    finally:
        cluster.stop()
