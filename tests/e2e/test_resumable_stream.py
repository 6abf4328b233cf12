"""A gateway SIGKILLed under a resumable stream: the client resumes on another gateway with its
Last-Event-ID, that gateway takes the request over, and the stream the client assembled equals
HF generate() with no event id repeated or skipped."""

import json
import signal
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tandem.cluster import keys
from tandem.launcher import free_port, wait_healthy
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

MAX_TOKENS = 300
EVENTS_BEFORE_KILL = 20
PROMPT = "The gateway that streams this answer will be killed, and another one will finish it"


@pytest.fixture
def two_gateway_cluster(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers inherit it: two cores are shared
    c = LocalCluster(tiny_llama, str(tmp_path), tokens_per_block=4, max_num_tokens=64, max_seq_len=512)
    second_port = free_port()
    c.start_service("decode", "decode-0")
    c.start_service("prefill", "prefill-0")
    c.start_service("gateway")
    c.start_service("gateway", name="gateway-2", port=second_port)
    second_url = f"http://{c.settings.host}:{second_port}"
    procs = list(c.procs.values())
    if not (wait_healthy(f"{c.base_url}/health", procs, 180) and wait_healthy(f"{second_url}/health", procs, 60)):
        c.stop()
        raise RuntimeError(c.logs())
    yield c, second_url
    c.stop()


def _events(lines):
    """(id, payload) per SSE event from response lines."""
    event: dict = {}
    for line in lines:
        if line:
            name, _, value = line.partition(": ")
            event[name] = value
            continue
        if event:
            data = event["data"]
            yield event["id"], data if data == "[DONE]" else json.loads(data)
            event = {}


def test_a_stream_survives_its_gateway_being_killed(two_gateway_cluster, hf_greedy, tiny_llama):
    cluster, second_url = two_gateway_cluster
    model = cluster.settings.model_name
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"resumable": True}}
    received = []
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        for event in _events(response.iter_lines()):
            received.append(event)
            if len(received) == EVENTS_BEFORE_KILL:
                cluster.procs["gateway"].send_signal(signal.SIGKILL)  # mid-stream, the client still reading
                break
    cluster.procs["gateway"].wait(10)
    assert received[-1][1] != "[DONE]"
    started = time.monotonic()
    headers = {"Last-Event-ID": received[-1][0]}
    with httpx.stream("GET", f"{second_url}/v1/streams/{request_id}", headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        received += list(_events(response.iter_lines()))
    assert time.monotonic() - started < 60

    assert [i for i, _ in received] == [f"{request_id}.{seq}" for seq in range(len(received))]
    assert received[-1][1] == "[DONE]"
    chunks = [p for _, p in received[:-1]]
    assert all("error" not in p for p in chunks), chunks[-1]
    token_ids = [t for p in chunks for t in p["choices"][0]["token_ids"]]
    text = "".join(p["choices"][0]["text"] for p in chunks)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = hf_greedy(tokenizer(PROMPT).input_ids, MAX_TOKENS)
    assert token_ids == expected
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the second gateway resubmitted it (a wire id after the lost gateway's): it was not merely replayed
    assert cluster.redis.hget(keys.sse_request(request_id), "wire") == f"{request_id}.4".encode()
    info = cluster.wait_blocks_free("decode", "decode-0")
    assert info.num_free_blocks == info.num_total_blocks
    cluster.wait_blocks_free("prefill", "prefill-0")
