"""A registry record that does not decode (a field of the wrong type, e.g. a string block count)
is skipped: requests go to the good workers and get 200, never a 500. Empty prompts and an
infinite temperature are refused with 400 and never reach a worker."""

from __future__ import annotations

import dataclasses
import time

import httpx
import msgpack
import pytest

from tandem.cluster import keys
from tandem.cluster.messages import WorkerInfo, encode
from tests.gateway.conftest import post, register_prefill, token_script


def _bad_record(worker_id: str, **change) -> bytes:
    info = WorkerInfo(worker_id=worker_id, role="decode", model="tiny", inbox=keys.inbox("decode", worker_id), pid=0,
                      host="test", started_at=0.0, heartbeat_at=time.time(), num_total_blocks=64, num_free_blocks=64)
    return msgpack.packb({**msgpack.unpackb(encode(info), raw=False), **change}, use_bin_type=True)


def test_a_record_with_a_string_block_count_is_skipped_and_requests_still_succeed(serve, fake_worker, rclient,
                                                                                  text_ids):
    good = fake_worker(token_script(text_ids[:3]), worker_id="decode-good")
    # more room than the good one: were it read, it would be picked first
    rclient.set(keys.worker("decode", "decode-bad"), _bad_record("decode-bad", num_total_blocks="640",
                                                                 num_free_blocks=640), px=30_000)
    rclient.set(keys.worker("decode", "decode-worse"), _bad_record("decode-worse", block_size=None), px=30_000)
    register_prefill(rclient)
    rclient.set(keys.worker("prefill", "prefill-bad"), _bad_record("prefill-bad", role="prefill", pid="1"), px=30_000)
    server = serve()
    for _ in range(3):
        response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
    assert len(good.requests) == 3
    assert not rclient.exists(keys.inbox("decode", "decode-bad"))  # nothing was sent there


@pytest.mark.parametrize("body", [
    '{"prompt": ""', '{"prompt": []', '{"prompt": [[]]', '{"prompt": [""]',
    '{"prompt": "hi", "temperature": 1e999',  # a JSON number that parses as infinity
])
def test_an_empty_prompt_or_an_infinite_temperature_is_refused_and_reaches_no_worker(serve, fake_worker, rclient,
                                                                                     text_ids, body):
    worker = fake_worker(token_script(text_ids[:3]))
    register_prefill(rclient)
    server = serve()
    response = httpx.post(f"{server.url}/v1/completions", content=body + ', "max_tokens": 3}',
                          headers={"content-type": "application/json"}, timeout=20)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("prompt", "temperature")
    assert worker.requests == [] and rclient.xlen(keys.inbox("decode", worker.worker_id)) == 0
