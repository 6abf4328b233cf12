"""A decode worker killed mid-stream: the gateway resumes the request on the other
decode worker, and the client's one stream still equals HF generate() token for token."""

import os

import httpx
from transformers import AutoTokenizer

from tests.e2e.serve_cluster import Stream

MAX_TOKENS = 460
PROMPT = "The decode worker that holds this request will be killed while it streams"


def test_stream_survives_its_decode_worker_being_killed(two_decode_cluster, hf_greedy, tiny_llama):
    cluster = two_decode_cluster
    model = os.path.basename(tiny_llama)
    client = Stream(cluster.base_url, model, PROMPT, MAX_TOKENS, ignore_eos=True)
    client.start()
    victim = cluster.kill_busy_worker("decode", lambda: len(client.arrivals) > 5)  # once tokens flow
    assert victim is not None, f"the request never ran: {client.error}\n{cluster.logs()}"
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
