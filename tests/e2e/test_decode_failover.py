"""A decode worker killed mid-stream: the gateway resumes the request on the other
decode worker, and the client's one stream still equals HF generate() token for token."""

import json
import os
import signal
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tandem.launcher import wait_healthy
from tests.e2e.cluster import LocalCluster

MAX_TOKENS = 460
PROMPT = "The decode worker that holds this request will be killed while it streams"


@pytest.fixture
def two_decode_cluster(tiny_llama, tmp_path):
    c = LocalCluster(tiny_llama, str(tmp_path), tokens_per_block=4, max_num_tokens=64, max_seq_len=512)
    for worker_id in ("decode-0", "decode-1"):
        c.start_service("decode", worker_id)
    c.start_service("prefill", "prefill-0")
    c.start_service("gateway")
    if not wait_healthy(f"{c.base_url}/health", list(c.procs.values()), 180):
        c.stop()
        raise RuntimeError(c.logs())
    deadline = time.monotonic() + 30
    while not all(c.worker("decode", w) for w in ("decode-0", "decode-1")) and time.monotonic() < deadline:
        time.sleep(0.1)
    yield c
    c.stop()


def _stream(base_url, model, out):
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    out.update(token_ids=[], finish=None, done=False, chunks=0)
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    out["done"] = True
                    continue
                choice = json.loads(payload)["choices"][0]
                if "error" in json.loads(payload):
                    out["error"] = payload
                out["token_ids"] += choice.get("token_ids") or []
                out["finish"] = choice.get("finish_reason") or out["finish"]
                out["chunks"] += 1
    except Exception as exc:  # reported by the assertions below
        out["exception"] = repr(exc)


def test_stream_survives_its_decode_worker_being_killed(two_decode_cluster, hf_greedy, tiny_llama):
    cluster = two_decode_cluster
    model = os.path.basename(tiny_llama)
    out: dict = {}
    client = threading.Thread(target=_stream, args=(cluster.base_url, model, out))
    client.start()
    victim, deadline = None, time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:  # the worker running it, once tokens flow
        for worker_id in ("decode-0", "decode-1"):
            info = cluster.worker("decode", worker_id)
            if info is not None and info.num_running > 0 and out.get("chunks", 0) > 5:
                victim = worker_id
        time.sleep(0.02)
    assert victim is not None, f"the request never ran: {out}\n{cluster.logs()}"
    cluster.procs[victim].send_signal(signal.SIGKILL)
    tokens_at_kill = len(out["token_ids"])
    client.join(120)
    assert not client.is_alive()
    assert out.get("status") == 200 and out["done"] and "exception" not in out and "error" not in out, out
    assert 0 < tokens_at_kill < MAX_TOKENS, "killed after the request had finished: the test proves nothing"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert out["token_ids"] == hf_greedy(tokenizer(PROMPT).input_ids, MAX_TOKENS)
    assert out["finish"] == "length"
    survivor = "decode-1" if victim == "decode-0" else "decode-0"
    cluster.wait_blocks_free("decode", survivor)
    metrics = httpx.get(f"{cluster.base_url}/metrics").text
    assert "tandem_gateway_failovers_total 1.0" in metrics
