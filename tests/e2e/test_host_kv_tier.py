"""End to end on the CPU: the host KV tier under a worker's prefix cache (``--kv-host-cache-gb``),
through real redis, gateway and worker processes, in both layouts: a prefill worker's cache
(separate pools), and the cache of the worker that runs both pools on one device (colocated).

32 conversations of 6 turns, each turn's prompt the whole conversation so far (token ids: the
previous prompt, its answer, a new question), visited round robin: between two turns of one
conversation the other 31 pass through a pool far too small to keep them, so its prefix comes
back from host memory. Every answer equals HF transformers' greedy output.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tandem.launcher import wait_healthy
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

BLOCK = 4
CONVERSATIONS, TURNS, MAX_TOKENS = 32, 6, 4


@pytest.fixture(scope="module", params=["separate", "colocated"])
def tiered_cluster(request, tiny_llama, tmp_path_factory):
    """-> (cluster, the role and id of the worker whose cache it is). Separate: the prefill pool
    holds 256 tokens (the decode pool 2,048); colocated: the one pool 512 (four turns in flight
    hold about 460). The conversations reach about 32 x 100."""
    layout = request.param
    c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp(f"logs-host-tier-{layout}")), layout=layout,
                     tokens_per_block=BLOCK, max_num_tokens=64, max_seq_len=256, max_input_len=200,
                     enable_prefix_caching=True, max_tokens_in_paged_kv_cache=256, kv_host_cache_gb=0.01)
    if layout == "colocated":
        c.start_service("colocated", "decode-0", max_tokens_in_paged_kv_cache=512)
        owner = ("decode", "decode-0")
    else:
        c.start_service("decode", "decode-0", max_tokens_in_paged_kv_cache=2048)
        c.start_service("prefill", "prefill-0")
        owner = ("prefill", "prefill-0")
    c.start_service("gateway")
    if not wait_healthy(f"{c.base_url}/health", list(c.procs.values()), 180):
        c.stop()
        raise RuntimeError(f"cluster did not become healthy:\n{c.logs()}")
    yield c, owner
    c.stop()


def test_multi_turn_chats_get_prefix_hits_from_host_memory(tiered_cluster, hf_greedy, tiny_llama):
    cluster, (role, worker_id) = tiered_cluster
    vocab = 450  # the tiny tokenizer has 500 tokens
    g = torch.Generator().manual_seed(11)
    questions = [[torch.randint(5, vocab, (int(torch.randint(6, 12, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
    history = [[] for _ in range(CONVERSATIONS)]
    cached = []

    def turn(http: httpx.Client, conv: int, t: int) -> None:
        prompt = history[conv] + questions[conv][t]
        resp = http.post("/v1/completions", json={"model": cluster.settings.model_name, "prompt": prompt,
                                                  "max_tokens": MAX_TOKENS, "temperature": 0,
                                                  "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        out = resp.json()
        answer = out["choices"][0]["token_ids"]
        assert answer == hf_greedy(prompt, MAX_TOKENS), (conv, t)
        if t:
            cached.append(out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
        history[conv] = prompt + [a if a < 500 else 5 for a in answer]  # the model's vocabulary exceeds the tokenizer's

    with httpx.Client(base_url=cluster.base_url, timeout=120) as http, ThreadPoolExecutor(4) as pool:
        for t in range(TURNS):
            list(pool.map(lambda conv: turn(http, conv, t), range(CONVERSATIONS)))
    info = cluster.worker(role, worker_id)
    assert info.host_tier_capacity > 0 and info.host_tier_hits > 0, info
    assert info.host_tier_bytes_in > 0 and info.host_tier_bytes_out > 0
    metrics = httpx.get(f"{cluster.base_url}/metrics").text
    assert f'tandem_kv_cache_hit_blocks_total{{tier="host",worker="{worker_id}"}}' in metrics
    assert f'tandem_kv_host_tier_bytes_total{{direction="to_device",worker="{worker_id}"}}' in metrics
    # most later turns reuse the earlier turn's prompt, which the device pool could not keep
    assert sum(1 for n in cached if n > 0) >= len(cached) // 2, cached
