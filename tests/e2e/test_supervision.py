"""Faults injected into `tandem serve` on real processes: every stream still equals HF greedy.

kill -9 of a decode worker (with a second one, and alone: restarted), of the prefill worker
and of the launcher's own redis-server while 8 streams decode; SIGTERM drains them to the
end; a second signal ends them cleanly. Each test ends with every decode pool's blocks free,
no pool file and no process left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.e2e.serve_cluster import Serve, record_fault, running, start_streams, wait_tokens

pytestmark = pytest.mark.slow

PROMPTS = [f"Stream {i} of the supervision test begins here with a few words" for i in range(8)]
MAX_TOKENS = 80


@pytest.fixture
def reference(tiny_llama, hf_greedy):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    cache = {}

    def expected(prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        if (tuple(ids), max_tokens) not in cache:
            cache[tuple(ids), max_tokens] = hf_greedy(ids, max_tokens)
        return cache[tuple(ids), max_tokens]

    return expected


def _assert_all_equal_hf(streams, reference, fault: str | None = None, fault_at: float = 0.0):
    if fault is not None:
        for stream in streams:
            stream.join(180)
        record_fault(fault, streams, [reference(s.body["prompt"], s.body["max_tokens"]) for s in streams], fault_at,
                     leaked_blocks=0)
    for stream in streams:
        stream.join(180)
        assert not stream.is_alive()
        assert stream.status == 200 and stream.done and stream.error is None, (stream.error, len(stream.token_ids))
        expected = reference(stream.body["prompt"], stream.body["max_tokens"])
        assert stream.finish == ("length" if len(expected) == stream.body["max_tokens"] else "stop")
        assert stream.token_ids == expected


def _kill(serve: Serve, name: str) -> int:
    pid = serve.pids[name]
    os.kill(pid, signal.SIGKILL)
    return pid


@contextlib.contextmanager
def _serving(model: str, tmp_path, **kwargs):
    """tandem serve for one test; at its end every pool's blocks are free, and no pool file
    and no process is left."""
    serve = Serve(model, tmp_path, **kwargs)
    try:
        yield serve
        serve.wait_blocks_free()
        assert serve.stop() == 0
        assert serve.pool_files() == set()
    finally:
        if serve.proc.poll() is None:
            serve.stop()


@pytest.mark.parametrize("num_decode", [2, 1])
def test_a_killed_decode_worker_loses_no_stream(tiny_llama, tmp_path, reference, num_decode):
    """Two decode workers: the streams of the killed one go on on the other. One: it is
    restarted, and its streams pause, then go on on its new run."""
    with _serving(tiny_llama, tmp_path, num_decode=num_decode) as serve:
        streams = start_streams(serve, PROMPTS, MAX_TOKENS)
        wait_tokens(streams, 8)
        fault_at = time.monotonic()
        killed = _kill(serve, "decode-0")
        _assert_all_equal_hf(streams, reference, f"kill -9 of a decode worker ({num_decode} decode workers)",
                             fault_at)
        assert not running(killed)
        if num_decode == 1:
            assert "decode-0 restarted" in serve.log()
            (decode,) = [w for w in serve.workers() if w["role"] == "decode"]
            assert decode["num_restarts"] == 1
            assert 'tandem_worker_restarts_total{role="decode",worker="decode-0"} 1.0' in \
                httpx.get(f"{serve.base_url}/metrics").text
        metrics = httpx.get(f"{serve.base_url}/metrics").text
        assert "tandem_gateway_failovers_total" in metrics


def test_a_killed_prefill_worker_is_restarted_and_its_jobs_are_sent_again(tiny_llama, tmp_path, reference):
    """Long prompts in chunks of 32 tokens: the lone prefill worker dies while it computes them.
    The decode worker sends its jobs again once the restarted one registers."""
    prompts = [[3 + (7 * i + j) % 400 for j in range(160)] for i in range(8)]
    with _serving(tiny_llama, tmp_path) as serve:
        streams = start_streams(serve, prompts, MAX_TOKENS)
        deadline = time.monotonic() + 30
        while any(s.status is None for s in streams) and time.monotonic() < deadline:
            time.sleep(0.005)  # every request admitted and submitted
        fault_at = time.monotonic()
        _kill(serve, "prefill-0")
        assert any(not s.token_ids for s in streams), "every prompt was computed already: nothing proven"
        _assert_all_equal_hf(streams, reference, "kill -9 of the lone prefill worker mid-prefill", fault_at)
        assert "prefill-0 restarted" in serve.log()


def test_a_killed_redis_server_is_restarted_and_the_streams_complete(tiny_llama, tmp_path, reference):
    with _serving(tiny_llama, tmp_path) as serve:
        streams = start_streams(serve, PROMPTS, MAX_TOKENS)
        wait_tokens(streams, 8)
        fault_at = time.monotonic()
        _kill(serve, "redis")
        _assert_all_equal_hf(streams, reference, "kill -9 of tandem serve's redis-server", fault_at)
        assert "redis restarted" in serve.log()


def test_sigterm_lets_the_open_streams_finish_then_stops_everything(tiny_llama, tmp_path, reference):
    serve = Serve(tiny_llama, tmp_path)
    pids = dict(serve.pids)
    assert [os.path.basename(f) for f in serve.pool_files()] == [f"tandem-kv-decode-0-{pids['decode-0']}"]
    streams = start_streams(serve, PROMPTS, 200)  # still open when the late request comes
    wait_tokens(streams, 8)
    fault_at = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    refused = httpx.post(f"{serve.base_url}/v1/completions", json={"model": serve.model, "prompt": "late",
                                                                    "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["retry-after"] == "1"
    _assert_all_equal_hf(streams, reference, "SIGTERM to tandem serve (drain)", fault_at)
    assert serve.proc.wait(60) == 0
    assert not [name for name, pid in pids.items() if running(pid)]
    assert serve.pool_files() == set()


def test_a_second_signal_ends_every_stream_with_an_error_event_and_done(tiny_llama, tmp_path):
    serve = Serve(tiny_llama, tmp_path, "--shutdown-timeout-s", "60", "--max-seq-len", "512")
    pids = dict(serve.pids)
    streams = start_streams(serve, PROMPTS, 480)  # long enough to be open at the second signal
    wait_tokens(streams, 4)
    serve.proc.send_signal(signal.SIGINT)  # Ctrl-C
    time.sleep(0.3)
    serve.proc.send_signal(signal.SIGINT)  # and again
    for stream in streams:
        stream.join(60)
        assert stream.done and stream.error is not None and "stopped" in stream.error, (stream.error, stream.done)
        assert stream.finish == "error"
    assert serve.proc.wait(60) == 0
    assert not [name for name, pid in pids.items() if running(pid)]
    assert serve.pool_files() == set()
