"""A decode worker killed mid-stream: the gateway resumes the request on the other
decode worker, and the client's one stream still equals HF generate() token for token."""

import os
import signal
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tandem.launcher import wait_healthy
from tests.e2e.cluster import LocalCluster
from tests.e2e.serve_cluster import Stream

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


def test_stream_survives_its_decode_worker_being_killed(two_decode_cluster, hf_greedy, tiny_llama):
    cluster = two_decode_cluster
    model = os.path.basename(tiny_llama)
    client = Stream(cluster.base_url, model, PROMPT, MAX_TOKENS, ignore_eos=True)
    client.start()
    victim, deadline = None, time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:  # the worker running it, once tokens flow
        for worker_id in ("decode-0", "decode-1"):
            info = cluster.worker("decode", worker_id)
            if info is not None and info.num_running > 0 and len(client.arrivals) > 5:
                victim = worker_id
        time.sleep(0.02)
    assert victim is not None, f"the request never ran: {client.error}\n{cluster.logs()}"
    cluster.procs[victim].send_signal(signal.SIGKILL)
    tokens_at_kill = len(client.token_ids)
    client.join(120)
    assert not client.is_alive()
    assert client.status == 200 and client.done and client.error is None, client.error
    assert 0 < tokens_at_kill < MAX_TOKENS, "killed after the request had finished: the test proves nothing"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert client.token_ids == hf_greedy(tokenizer(PROMPT).input_ids, MAX_TOKENS)
    assert client.finish == "length"
    survivor = "decode-1" if victim == "decode-0" else "decode-0"
    cluster.wait_blocks_free("decode", survivor)
    metrics = httpx.get(f"{cluster.base_url}/metrics").text
    assert "tandem_gateway_failovers_total 1.0" in metrics
