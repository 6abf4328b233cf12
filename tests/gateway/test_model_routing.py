"""Workers of another model sharing the Redis are another cluster's: the gateway neither routes
to them nor counts them as its own for health."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import post, register_prefill, token_script


def test_requests_go_only_to_workers_of_the_gateways_model(serve, fake_worker, rclient, text_ids):
    other = fake_worker(token_script(text_ids[:3]), worker_id="decode-other", model="another-model",
                        num_free_blocks=64)
    ours = fake_worker(token_script(text_ids[:3]), worker_id="decode-ours", num_free_blocks=8)
    register_prefill(rclient)
    server = serve()
    for _ in range(3):
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200
    assert (len(ours.requests), len(other.requests)) == (3, 0)  # though the other has more room
    assert httpx.get(f"{server.url}/health").json()["decode_workers"] == 1


def test_only_workers_of_another_model_is_no_worker(serve, fake_worker, rclient, text_ids):
    fake_worker(token_script(text_ids[:3]), worker_id="decode-other", model="another-model")
    register_prefill(rclient)
    server = serve()
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.json()["reason"] == "no live decode worker"
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker_available"
