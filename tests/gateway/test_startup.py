"""Gateway startup: Redis's side of admission is ready before the first request."""

from __future__ import annotations

import httpx
from conftest import ServerThread, free_port, make_settings

from cluster.admission import RELEASE_LUA, RESERVE_LUA
from gateway.app import create_app


def test_the_admission_scripts_are_in_redis_before_the_first_request(model_dir, tokenizer, redis_url, rclient):
    rclient.script_flush()
    shas = [rclient.script_load(src) for src in (RESERVE_LUA, RELEASE_LUA)]  # the shas redis-py would use
    rclient.script_flush()
    assert rclient.script_exists(*shas) == [False, False]
    with ServerThread(create_app(make_settings(model_dir, redis_url), tokenizer=tokenizer)):
        assert rclient.script_exists(*shas) == [True, True]


def test_the_gateway_starts_without_redis_and_says_so_on_health(model_dir, tokenizer):
    settings = make_settings(model_dir, f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with ServerThread(create_app(settings, tokenizer=tokenizer)) as server:
        response = httpx.get(server.url + "/health", timeout=10)
    assert response.status_code == 503
