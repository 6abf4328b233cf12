"""Several gateway processes on one port (``tandem serve --gateway-processes``).

Two real gateways bind the same port with SO_REUSEPORT beside one colocated worker: concurrent
clients, each on its own connection, are spread over both by the kernel, every answer equals HF
greedy, and a scrape of either process counts every request of both (prometheus_client's
multiprocess directory).
"""

import asyncio
import os
import re

import httpx
import pytest
from transformers import AutoTokenizer

from tandem.launcher import METRICS_DIR_ENV, wait_healthy
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

NUM_REQUESTS = 24
MAX_TOKENS = 8


@pytest.fixture
def two_gateways(tiny_llama, tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    c = LocalCluster(tiny_llama, str(tmp_path), "colocated", tokens_per_block=4, max_num_tokens=64,
                     max_seq_len=256, reuse_port=True)
    env = {METRICS_DIR_ENV: str(metrics_dir)}
    c.start_service("colocated", "decode-0")
    c.start_service("gateway", env=env)
    c.start_service("gateway", name="gateway-1", env=env, admin_port=0)
    if not wait_healthy(f"{c.base_url}/health", list(c.procs.values()), 180.0):
        c.stop()
        raise RuntimeError(f"cluster did not become healthy:\n{c.logs()}")
    yield c, metrics_dir
    c.stop()


async def _complete(base_url, model, prompt):
    async with httpx.AsyncClient(timeout=120) as client:  # a connection of its own
        resp = await client.post(f"{base_url}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _finished_total(text: str) -> float:
    return sum(float(v) for v in re.findall(r'^tandem_gateway_finished_requests_total\{[^}]*\} (\S+)$', text, re.M))


def test_two_gateway_processes_share_a_port_and_their_metrics(two_gateways, tiny_llama, hf_greedy):
    cluster, metrics_dir = two_gateways
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(NUM_REQUESTS)]

    async def run_all():
        return await asyncio.gather(*[_complete(cluster.base_url, cluster.settings.model_name, p) for p in prompts])

    outputs = asyncio.run(run_all())
    for prompt, token_ids in zip(prompts, outputs):
        assert token_ids == hf_greedy(tok(prompt)["input_ids"], MAX_TOKENS), prompt

    # both processes served requests: each wrote its own counters (files named by pid)
    pids = {int(m.group(1)) for name in os.listdir(metrics_dir) if (m := re.match(r"counter_(\d+)\.db$", name))}
    gateway_pids = {cluster.procs["gateway"].pid, cluster.procs["gateway-1"].pid}
    assert pids == gateway_pids, (pids, gateway_pids)
    # any scrape (a new connection lands on either process) counts every request of both
    for _ in range(4):
        text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
        assert _finished_total(text) == NUM_REQUESTS, text
        assert "tandem_gateway_requests_running 0.0" in text
        assert 'tandem_worker_num_total_blocks{role="decode",worker="decode-0"}' in text


def test_auto_gateway_processes():
    from tandem.cluster.settings import Settings
    from tandem.launcher import auto_gateway_processes

    assert auto_gateway_processes(Settings(device="cpu"), num_gpus=1) == 1
    assert auto_gateway_processes(Settings(device="auto"), num_gpus=0) == 1
    cores = len(os.sched_getaffinity(0))
    assert auto_gateway_processes(Settings(device="auto"), num_gpus=1) == max(1, min(4, cores // 4))
