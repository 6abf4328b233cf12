"""Gateway startup: Redis's side of admission is ready before the first request."""

from __future__ import annotations

import socket
import time

import httpx
from conftest import ServerThread, free_port, make_settings

from tandem.cluster.admission import RELEASE_LUA, RESERVE_LUA
from tandem.gateway.app import create_app
from tandem.gateway.service import STARTUP_WAIT_S


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


def test_a_redis_that_accepts_but_never_answers_delays_startup_only_briefly(model_dir, tokenizer):
    # e.g. a stopped (SIGSTOP) or wedged redis-server: the kernel still completes the TCP
    # handshake, so only the read timeout (POLL_S + 10 s, then a retry) would end the call
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(64)  # never accepted: connections sit in the backlog, nothing is answered
        settings = make_settings(model_dir, f"redis://127.0.0.1:{stuck.getsockname()[1]}/0")
        started = time.monotonic()
        with ServerThread(create_app(settings, tokenizer=tokenizer)):  # raises if not started within 10 s
            took = time.monotonic() - started
            stuck.close()  # the held connections are reset: shutdown need not wait out the timeouts
    assert took < STARTUP_WAIT_S + 3.0
