"""Every request the gateway takes ends under exactly one finish reason in
``tandem_gateway_finished_requests_total``: N clients that go away, wherever they are (waiting
for room in the admission queue, admitted, streaming, non-streaming), raise ``abort`` by N."""

from __future__ import annotations

import re
import threading

import httpx

from tests.gateway.conftest import token_script, wait_for

NUM_CLIENTS = 12


def _finished(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {reason: float(value) for reason, value in
            re.findall(r'tandem_gateway_finished_requests_total\{finish_reason="([^"]+)"\} (\S+)', text)}


def _leave(server, body: dict, streamed: bool) -> None:
    """Send one request and go away after a second (queued: before any byte came back) or after
    the first streamed line."""
    try:
        with httpx.Client(base_url=server.url, timeout=1.0) as http:
            if streamed:
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    next(response.iter_lines())
            else:
                http.post("/v1/completions", json=body)
    except httpx.TimeoutException:
        pass


def test_every_client_that_goes_away_counts_once_as_abort(serve, fake_worker, text_ids):
    # room for one request at a time (7 of 8 blocks each): the others wait in the admission queue
    worker = fake_worker(token_script(text_ids * 40, "length", delay_s=0.05), num_total_blocks=8,
                         num_free_blocks=8)
    server = serve()
    body = {"prompt": "hi", "max_tokens": 100}
    clients = [threading.Thread(target=_leave, args=(server, body, i % 2 == 0)) for i in range(NUM_CLIENTS)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(30)
    assert wait_for(lambda: sum(_finished(server).values()) >= NUM_CLIENTS, timeout_s=15), _finished(server)
    assert _finished(server) == {"abort": NUM_CLIENTS}
    assert wait_for(lambda: "tandem_gateway_requests_running 0.0" in httpx.get(server.url + "/metrics").text)
    assert 1 <= len(worker.requests) < NUM_CLIENTS  # some were admitted, the others left while queued
