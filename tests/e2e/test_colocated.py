"""The colocated layout against the disaggregated one, and its failover.

The same requests sent to a cluster of each layout give the same answers: seeded sampling
with ``n``, penalties and logit bias, structured outputs, logprobs and prompt logprobs
(prompts longer than the 16-token step budget, sent while a long stream decodes, so that
prompt chunks share steps with decode rows). Two colocated workers: one killed mid-stream, the stream continues on the
other and still equals HF greedy.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.e2e.cluster import LAYOUTS, LocalCluster
from tests.e2e.serve_cluster import Stream

pytestmark = pytest.mark.slow

LONG = ("A serving system answers many requests at once: it reads the prompt, computes the keys and values "
        "of every token, and then writes one new token at a time until the answer is complete.")
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}
REQUESTS = {
    "seeded n": {"prompt": LONG, "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 11, "n": 3},
    "penalties": {"prompt": "one, two, three, four, five, six, seven, eight, nine, ten. " * 2, "max_tokens": 20,
                  "temperature": 0.0, "presence_penalty": 0.8, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.3, "logit_bias": {"5": -100, "17": 3}},
    "structured": {"prompt": LONG, "max_tokens": 40, "temperature": 1.0, "seed": 3,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
    "logprobs": {"prompt": LONG, "max_tokens": 8, "temperature": 0.0, "logprobs": 3, "echo": True,
                 "prompt_logprobs": 2},
    "min_tokens": {"prompt": "Hello world!", "max_tokens": 12, "min_tokens": 10, "temperature": 0.0},
}


@pytest.fixture(scope="module")
def clusters(tiny_llama, tmp_path_factory):
    started = {}
    try:
        for layout in LAYOUTS:
            started[layout] = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp(f"logs-{layout}")), layout,
                                           tokens_per_block=4, max_num_tokens=16, max_seq_len=256,
                                           max_input_len=200, decode_run_ahead="on").start()
        yield started
    finally:
        for cluster in started.values():
            cluster.stop()


async def _answers(cluster: LocalCluster) -> dict[str, list[dict]]:
    """The answers to REQUESTS, sent at once while a long stream decodes: their prompt chunks
    find a decode row running, whatever the timing of their arrival."""
    model = cluster.settings.model_name
    background = Stream(cluster.base_url, model, "Count:", 240, ignore_eos=True)
    background.start()
    deadline = time.monotonic() + 120
    while not background.arrivals and background.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert background.arrivals, f"the background stream never decoded: {background.error}"

    async def one(client, body):
        resp = await client.post("/v1/completions", json={"model": model, "return_token_ids": True, **body})
        assert resp.status_code == 200, resp.text
        return resp.json()

    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as client:  # all at once: shared steps
        results = await asyncio.gather(*(one(client, body) for body in REQUESTS.values()))
    background.join(120)
    assert background.done and background.error is None, background.error
    return dict(zip(REQUESTS, results))


def _close(a, b, path="") -> None:
    """Equal, floats within 1e-4 (the two layouts sum the same products in other orders)."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, abs_tol=1e-4) or (math.isinf(a) and a == b), f"{path}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{path}: {sorted(a)} != {sorted(b)}"
        for key in a:
            _close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_both_layouts_give_the_same_answers(clusters):
    answers = {layout: asyncio.run(_answers(cluster)) for layout, cluster in clusters.items()}
    separate, colocated = answers["separate"], answers["colocated"]
    for name in REQUESTS:
        _close(separate[name]["choices"], colocated[name]["choices"], name)
        assert separate[name]["usage"] == colocated[name]["usage"], name
    assert len(colocated["seeded n"]["choices"]) == 3
    json.loads(colocated["structured"]["choices"][0]["text"])  # the schema held
    assert colocated["logprobs"]["choices"][0]["prompt_logprobs"]
    # the colocated worker really mixed prompt chunks into decode steps (its heartbeat tells)
    deadline = time.monotonic() + 5
    while clusters["colocated"].worker("decode", "decode-0").num_mixed_steps == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert clusters["colocated"].worker("decode", "decode-0").num_mixed_steps > 0


def test_a_killed_colocated_worker_s_stream_continues_on_the_other(tiny_llama, tmp_path, hf_greedy):
    max_tokens = 300
    prompt = "The colocated worker that holds this request will be killed while it streams"
    cluster = LocalCluster(tiny_llama, str(tmp_path), "colocated", tokens_per_block=4, max_num_tokens=64,
                           max_seq_len=512)
    try:
        for worker_id in ("decode-0", "decode-1"):
            cluster.start_service("colocated", worker_id)
        cluster.start_service("gateway")
        from tandem.launcher import wait_healthy

        assert wait_healthy(f"{cluster.base_url}/health", list(cluster.procs.values()), 180.0), cluster.logs()
        client = Stream(cluster.base_url, cluster.settings.model_name, prompt, max_tokens, ignore_eos=True)
        client.start()
        victim = cluster.kill_busy_worker("decode", lambda: len(client.arrivals) > 5)
        assert victim is not None, f"the request never ran: {client.error}\n{cluster.logs()}"
        tokens_at_kill = len(client.token_ids)
        client.join(120)
        assert not client.is_alive()
        assert client.status == 200 and client.done and client.error is None, client.error
        assert 0 < tokens_at_kill < max_tokens, "killed after the request had finished: the test proves nothing"
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        assert client.token_ids == hf_greedy(tokenizer(prompt).input_ids, max_tokens)
        survivor = "decode-1" if victim == "decode-0" else "decode-0"
        cluster.wait_blocks_free("decode", survivor)
        assert "tandem_gateway_failovers_total 1.0" in httpx.get(f"{cluster.base_url}/metrics").text
    finally:
        cluster.stop()
