"""Tests for ``tandem bench serve`` (bench/serve.py): the client end to end against a
tiny in-process SSE server with known delays (conftest.py): load shapes, client processes,
failures and interruption. How a stream's tokens and times are counted:
test_serve_accounting.py; the metric math, SSE parsing and synthetic requests:
test_serve_metrics.py, test_serve_sse.py and test_datasets.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.bench import serve
from tandem.bench.datasets import arrival_offsets, synthetic_requests
from tandem.bench.serve_metrics import compute_metrics
from tandem.bench.serve_request import BenchConfig
from tests.bench.conftest import CHAT_TEMPLATE_TOKENS, ITL_S, TTFT_S, run_serve as _run

REPO = Path(__file__).resolve().parents[2]




def test_max_concurrency_completions(server, tmp_path, capsys):
    url, state = server
    out = tmp_path / "r.json"
    n, in_len, out_len = 8, 16, 4
    rc = _run(["--base-url", url, "--num-prompts", str(n), "--max-concurrency", "2",
               "--input-len", str(in_len), "--output-len", str(out_len),
               "--goodput", "ttft:5000", "tpot:5000", "--result-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms):" in text

    # what the server received
    assert len(state["bodies"]) == n and state["peak"] <= 2
    for body in state["bodies"]:
        assert body["model"] == "tiny-model"  # from GET /v1/models
        assert len(body["prompt"]) == in_len
        assert all(isinstance(t, int) and 10 <= t <= 1000 for t in body["prompt"])
        assert body["max_tokens"] == out_len and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0

    doc = json.loads(out.read_text())
    m = doc["metrics"]
    assert (m["completed"], m["failed"], m["incomplete"]) == (n, 0, 0)
    assert m["total_input_tokens"] == n * in_len
    assert m["total_output_tokens"] == n * out_len
    assert m["peak_concurrency"] == 2
    assert m["good_requests"] == n
    per_req = TTFT_S + (out_len - 1) * ITL_S
    assert m["duration_s"] >= 0.9 * (n / 2) * per_req  # the cap serialised the work
    # measured latencies agree with the server's delays (loose bounds)
    assert TTFT_S * 0.9 <= m["ttft_ms"]["median"] / 1e3 <= TTFT_S + 0.25
    assert ITL_S * 0.5 <= m["itl_ms"]["median"] / 1e3 <= ITL_S + 0.1
    assert ITL_S * 0.5 <= m["tpot_ms"]["median"] / 1e3 <= ITL_S + 0.1
    assert per_req * 0.9 <= m["e2el_ms"]["median"] / 1e3 <= per_req + 0.3
    assert m["request_throughput"] == pytest.approx(n / m["duration_s"])
    rows = doc["requests"]
    assert len(rows) == n and all(r["success"] and r["output_tokens"] == out_len for r in rows)
    assert all(len(r["itl_ms"]) == out_len - 1 for r in rows)


def test_request_rate_chat(server, tmp_path):
    url, state = server
    out = tmp_path / "r.json"
    n, rate, seed = 10, 25.0, 5
    rc = _run(["--base-url", url + "/v1", "--endpoint", "chat", "--model", "tiny-model",
               "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
               "--input-len-range", "4:12", "--output-len-range", "1:5",
               "--percentiles", "50,99.9", "--result-json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    m, rows = doc["metrics"], doc["requests"]
    specs = synthetic_requests(n, chat=True, input_len_range=(4, 12),
                               output_len_range=(1, 5), seed=seed)
    assert m["completed"] == n and m["failed"] == 0
    # usage.prompt_tokens (template included) is preferred over the nominal word count
    assert m["total_input_tokens"] == sum(s.prompt_len + CHAT_TEMPLATE_TOKENS for s in specs)
    assert m["total_output_tokens"] == sum(s.output_len for s in specs)
    assert "p99.9" in m["ttft_ms"]
    for body in state["bodies"]:
        assert body["messages"][0]["role"] == "user" and body["ignore_eos"] is True
    # requests went out no earlier than their gamma arrival times
    offsets = arrival_offsets(n, rate, 1.0, seed)
    starts = sorted(r["start_s"] for r in rows)
    assert all(s >= o - 0.005 for s, o in zip(starts, offsets))
    assert m["duration_s"] >= offsets[-1]
    # the empty role-only delta is not the first token
    assert min(r["ttft_ms"] for r in rows) >= TTFT_S * 0.9 * 1e3
    # one-token requests have no TPOT
    assert all((r["tpot_ms"] is None) == (r["output_tokens"] == 1) for r in rows)


def test_processes_split_the_concurrency_cap_exactly(server, tmp_path):
    url, state = server
    out = tmp_path / "r.json"
    assert _run(["--base-url", url, "--num-prompts", "6", "--num-processes", "2", "--max-concurrency", "1",
                 "--input-len", "4", "--output-len", "3", "--result-json", str(out)]) == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] == 6 and state["peak"] == 1 and m["peak_concurrency"] == 1


def test_failures_are_counted_with_messages(server, tmp_path, capsys):
    url, _ = server
    out = tmp_path / "r.json"
    rc = _run(["--base-url", url, "--model", "reject", "--num-prompts", "3",
               "--input-len", "4", "--output-len", "2", "--result-json", str(out)])
    assert rc == 1
    assert "model 'reject' does not exist" in capsys.readouterr().out
    m = json.loads(out.read_text())["metrics"]
    assert (m["completed"], m["failed"]) == (0, 3)
    assert m["errors"] == [{"error": "HTTP 404: model 'reject' does not exist", "count": 3}]
    assert m["ttft_ms"]["mean"] is None and m["request_throughput"] == 0

    rc = _run(["--base-url", url, "--model", "midstream-error", "--num-prompts", "2",
               "--input-len", "4", "--output-len", "3", "--result-json", str(out)])
    m = json.loads(out.read_text())["metrics"]
    assert rc == 1 and m["failed"] == 2
    assert m["errors"][0]["error"] == "error in stream: worker died"


def test_request_timeout_bounds_each_request(server, tmp_path):
    url, _ = server
    out = tmp_path / "r.json"
    t0 = time.monotonic()
    rc = _run(["--base-url", url, "--model", "slow", "--num-prompts", "2", "--input-len", "4",
               "--output-len", "2", "--request-timeout", "0.3", "--result-json", str(out)])
    assert time.monotonic() - t0 < 4.0
    m = json.loads(out.read_text())["metrics"]
    assert rc == 1 and m["failed"] == 2 and "timed out" in m["errors"][0]["error"]


def test_unreachable_server_and_bad_args(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # no server there: the model lookup fails cleanly
    assert _run(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]) == 2
    # with --model the requests fail as connection errors
    assert _run(["--base-url", f"http://127.0.0.1:{port}", "--model", "x",
                 "--num-prompts", "2", "--input-len", "3", "--output-len", "2"]) == 1
    assert "ConnectError" in capsys.readouterr().out
    assert _run(["--base-url", "http://127.0.0.1:1", "--model", "x",
                 "--goodput", "bogus:1"]) == 2
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--input-len", "3", "--input-len-range", "1:2"])


def test_stop_event_gives_partial_results(server):
    url, _ = server
    cfg = BenchConfig(base_url=url, model="tiny-model", max_concurrency=2)
    specs = synthetic_requests(20, chat=False, input_len=4, output_len=10)

    async def go():
        # stop once two requests are done (a fixed delay flaked on a loaded CI machine: none done in 0.5 s)
        stop, state = asyncio.Event(), serve.BenchState()

        async def stop_after_two():
            while sum(r.success for r in state.results) < 2:
                await asyncio.sleep(0.005)
            stop.set()

        watcher = asyncio.create_task(stop_after_two())
        try:
            return await serve.run_benchmark(cfg, specs, state=state, stop=stop)
        finally:
            watcher.cancel()

    state = asyncio.run(go())
    assert state.interrupted  # stopped early: 20 requests at 2 in flight take ~2 s
    m = compute_metrics(state.results, state.duration)
    assert m["completed"] >= 2 and m["incomplete"] >= 1
    assert m["completed"] + m["failed"] + m["incomplete"] == len(state.results) == 20


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_prints_partial_results(server, tmp_path):
    url, state = server
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.bench.serve", "--base-url", url, "--num-prompts", "40",
         "--max-concurrency", "2", "--input-len", "4", "--output-len", "10",
         "--result-json", str(out)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 20
        while len(state["bodies"]) < 5 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Serving Benchmark Result" in stdout
    doc = json.loads(out.read_text())
    m = doc["metrics"]
    assert m["interrupted"] is True and m["completed"] >= 2
    assert m["incomplete"] >= 1 and m["completed"] + m["failed"] + m["incomplete"] == 40
    assert sum(r["finished"] for r in doc["requests"]) == m["completed"] + m["failed"]


def test_several_client_processes_share_one_schedule(server, tmp_path):
    url, state = server
    out = tmp_path / "r.json"
    n, rate, seed = 12, 40.0, 3
    rc = _run(["--base-url", url, "--num-prompts", str(n), "--num-processes", "3", "--request-rate", str(rate),
               "--seed", str(seed), "--input-len", "8", "--output-len", "4", "--result-json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    m, rows = doc["metrics"], doc["requests"]
    assert (m["completed"], m["failed"]) == (n, 0) and len(state["bodies"]) == n
    assert sorted(r["index"] for r in rows) == list(range(n))  # every request once, merged in order
    assert all(r["output_tokens"] == 4 and len(r["itl_ms"]) == 3 for r in rows)
    # each request left no earlier than its arrival time on the shared clock
    offsets = arrival_offsets(n, rate, 1.0, seed)
    assert all(r["start_s"] >= o - 0.005 for r, o in zip(rows, offsets))
    assert m["duration_s"] >= offsets[-1] + TTFT_S
    assert TTFT_S * 0.9 <= m["ttft_ms"]["median"] / 1e3 <= TTFT_S + 0.25
