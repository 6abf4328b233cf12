"""Malformed entries in the live workers' inboxes (and a malformed registry record) crash
nothing: every process stays up, a request afterwards gets the same completion as before, and
a bad GenerateRequest that names its reply stream gets an error event there."""

from __future__ import annotations

import os
import time

import httpx
import msgpack
import pytest

from tandem.cluster import keys
from tandem.cluster.messages import FIELD, VERSION, decode, encode
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

PROBE = keys.gateway_output("malformed-probe")  # a reply stream no gateway reads: the test reads it
GOOD_REQUEST = {"request_id": "bad-0", "prompt_token_ids": [5, 6, 7], "max_tokens": 4, "reply_to": PROBE,
                "sampling": {"temperature": 0.0}, "kind": "GenerateRequest", "v": VERSION}


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers inherit it: one thread each on a shared CPU
    try:
        c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp("logs")), tokens_per_block=4,
                         max_num_tokens=16, max_seq_len=128, max_input_len=100).start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    yield c
    c.stop()


def _complete(cluster) -> dict:
    body = {"model": cluster.settings.model_name, "prompt": "The quick brown fox", "max_tokens": 12,
            "temperature": 0.0}
    response = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {"text": choice["text"], "finish_reason": choice["finish_reason"], "usage": response.json()["usage"]}


def _packed(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def _generate(request_id: str, **change) -> bytes:
    return _packed(**{**GOOD_REQUEST, "request_id": request_id, **change})


def _prefill_job(request_id: str, endpoint: dict, **change) -> bytes:
    job = {"request_id": request_id, "prompt_token_ids": [5, 6, 7, 8, 9], "sampling": {"temperature": 0.0},
           "max_tokens": 4, "dst_block_ids": [0, 1], "kv_endpoint": endpoint, "decode_worker_id": "decode-0",
           "reply_to": PROBE, "handoff_id": f"{request_id}#1", "kind": "PrefillJob", "v": VERSION}
    return _packed(**{**job, **change})


def _probe_events(cluster, count: int, timeout_s: float = 60.0) -> list:
    deadline, events = time.monotonic() + timeout_s, []
    while len(events) < count and time.monotonic() < deadline:
        for _stream, entries in cluster.redis.xread({PROBE: "0"}, count=1000, block=200) or []:
            events = [e for _id, fields in entries for e in decode(fields[FIELD]).unpack()]
    return events


def test_malformed_inbox_entries_crash_no_worker(cluster):
    before = _complete(cluster)
    decode_info = cluster.worker("decode", "decode-0")
    endpoint = decode_info.kv_endpoint
    decode_inbox, prefill_inbox = keys.inbox("decode", "decode-0"), keys.inbox("prefill", "prefill-0")

    refused = {  # each names the probe stream: its error event comes back there
        "bad-max-tokens-str": _generate("bad-max-tokens-str", max_tokens="4"),
        "bad-max-tokens-null": _generate("bad-max-tokens-null", max_tokens=None),
        "bad-temperature": _generate("bad-temperature", sampling={"temperature": "0.5"}),
        "bad-stop-ids": _generate("bad-stop-ids", stop_token_ids=None),
        "bad-empty-prompt": _generate("bad-empty-prompt", prompt_token_ids=[]),
        "bad-vocab": _generate("bad-vocab", prompt_token_ids=[5, 10**9]),  # the worker's own check
        "bad-too-long": _generate("bad-too-long", prompt_token_ids=[5] * 200),  # above max_seq_len
        # well-formed, but asking for more than the worker's context: refused, no block taken for it
        "bad-max-tokens-huge": _generate("bad-max-tokens-huge", max_tokens=10**12),
    }
    garbage = [
        _packed(**{**GOOD_REQUEST, "request_id": ["bad-list-id"]}),
        b"\xc1\x00garbage",
        _packed(kind="PrefillDone", v=VERSION, request_id="nobody", status="ok", first_token="5"),
        _packed(kind="AbortRequest", v=VERSION, request_id=7),
        _packed(kind="GenerateRequest", v=VERSION + 1, request_id="from-the-future"),
        _packed(kind="NoSuchMessage", v=VERSION),
        msgpack.packb([1, 2, 3]),
    ]
    for raw in [*refused.values(), *garbage]:
        cluster.redis.xadd(decode_inbox, {FIELD: raw})
    cluster.redis.xadd(decode_inbox, {b"not-m": b"x"})
    jobs = [
        _prefill_job("job-dst-out-of-range", endpoint, dst_block_ids=[0, decode_info.num_total_blocks + 5]),
        _prefill_job("job-empty-prompt", endpoint, prompt_token_ids=[]),
        _prefill_job("job-bad-types", endpoint, max_tokens="4", sampling={"top_p": None}),
        _prefill_job("job-endpoint", endpoint, kv_endpoint=["not", "a", "map"]),
        _prefill_job("job-vocab", endpoint, prompt_token_ids=[5, 10**9]),
        # well-formed, but beyond the worker's context, or with too few blocks for the prompt's KV:
        # refused before any forward (a job that ran would send its first token to the probe stream)
        _prefill_job("job-max-tokens-huge", endpoint, max_tokens=10**12),
        _prefill_job("job-short-dst", endpoint, dst_block_ids=[0]),
        b"\x93garbage",
        _packed(kind="AbortRequest", v=VERSION, request_id=None),
    ]
    for raw in jobs:
        cluster.redis.xadd(prefill_inbox, {FIELD: raw})
    # a registry record of a decode worker with a string block count (and more room than the real one)
    bad = msgpack.unpackb(encode(decode_info), raw=False)
    bad.update(worker_id="decode-bad", inbox=keys.inbox("decode", "decode-bad"), num_total_blocks="4096")
    cluster.redis.set(keys.worker("decode", "decode-bad"), _packed(**bad), px=60_000)

    events = _probe_events(cluster, len(refused))
    assert sorted(e.request_id for e in events) == sorted(refused)
    for event in events:
        assert (event.finish_reason, event.token_ids) == ("error", []) and event.error, event
    by_id = {e.request_id: e.error for e in events}
    assert "max_tokens" in by_id["bad-max-tokens-str"] and "temperature" in by_id["bad-temperature"]
    assert "prompt_token_ids" in by_id["bad-empty-prompt"] and "vocabulary" in by_id["bad-vocab"]
    assert "max_tokens 1000000000000" in by_id["bad-max-tokens-huge"] and "max_seq_len 128" in by_id["bad-max-tokens-huge"]

    deadline = time.monotonic() + 30
    while (cluster.redis.xlen(decode_inbox) or cluster.redis.xlen(prefill_inbox)) and time.monotonic() < deadline:
        time.sleep(0.1)  # every entry read
    time.sleep(1.0)
    everything = [e for _stream, entries in cluster.redis.xread({PROBE: "0"}, count=1000) or []
                  for _id, fields in entries for e in decode(fields[FIELD]).unpack()]
    assert sorted(e.request_id for e in everything) == sorted(refused)  # no bad job ran (none sent a token)
    assert {name: proc.poll() for name, proc in cluster.procs.items()} == {name: None for name in cluster.procs}
    assert _complete(cluster) == before
    info = cluster.wait_blocks_free("decode", "decode-0")  # nothing the garbage named holds a block
    assert info.num_waiting == 0 and cluster.wait_blocks_free("prefill", "prefill-0").num_running == 0
