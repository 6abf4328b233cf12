"""Tests for ``tandem bench serve`` (bench/serve.py): metric math, SSE parsing, and
the client end to end against a tiny in-process SSE server with known delays."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench import serve
from bench.datasets import arrival_offsets, parse_range, synthetic_requests
from bench.serve import (
    RequestResult,
    SSEDecoder,
    compute_metrics,
    decode_payload,
    iter_sse_data,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    summarize,
    tpot_seconds,
)

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- metric math


def test_summarize_percentiles_match_numpy_linear():
    vals = list(range(1, 101))
    s = summarize(vals, [50, 90, 99, 99.9])
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["p99.9"] == pytest.approx(99.901)
    assert s["min"] == 1 and s["max"] == 100
    assert s["std"] == pytest.approx(float(np.std(vals)))


def test_summarize_empty_and_single():
    s = summarize([], [50, 99])
    assert set(s) == {"mean", "median", "std", "min", "max", "p50", "p99"}
    assert all(v is None for v in s.values())
    s = summarize([7.0], [50, 99])
    assert s["mean"] == s["p99"] == s["median"] == 7.0


def test_parse_percentiles_and_goodput():
    assert parse_percentiles("50,90,99") == [50.0, 90.0, 99.0]
    assert parse_percentiles(" 99.9 ") == [99.9]
    for bad in ("0", "101", "", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1000"]) == {
        "ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    assert parse_goodput(["TTFT:1.5,tpot:2"]) == {"ttft": 1.5, "tpot": 2.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:0"], ["ttft:-3"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def _res(i, ttft, latency, out, itl=(), success=True, prompt_len=10, error=""):
    r = RequestResult(i, prompt_len, out)
    r.finished = True
    r.success = success
    r.error = error
    r.ttft, r.latency, r.output_tokens = ttft, latency, out
    r.itl = list(itl)
    return r


def test_tpot_definition_and_single_token():
    assert tpot_seconds(1.0, 0.2, 5) == pytest.approx(0.2)
    assert tpot_seconds(1.0, 0.2, 2) == pytest.approx(0.8)
    assert tpot_seconds(1.0, 0.2, 1) is None
    assert tpot_seconds(1.0, 0.2, 0) is None
    one = _res(0, 0.1, 0.1, 1)
    assert one.tpot is None
    # A single-token request has no TPOT: it meets any TPOT SLO, and stays out of the stats.
    assert meets_slos(one, {"tpot": 0.001})
    assert not meets_slos(one, {"ttft": 50})  # 100 ms > 50 ms
    m = compute_metrics([one, _res(1, 0.1, 0.5, 5)], 1.0, [50], {"tpot": 150})
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)  # only the 5-token request
    assert m["good_requests"] == 2


def test_compute_metrics_throughput_and_goodput():
    results = [
        _res(0, 0.100, 1.0, 10, itl=[0.1] * 9, prompt_len=100),   # tpot 100 ms
        _res(1, 0.300, 1.2, 10, itl=[0.1] * 9, prompt_len=200),   # ttft 300 ms, tpot 100 ms
        _res(2, 0.050, 0.5, 10, itl=[0.05] * 9, prompt_len=50),   # tpot 50 ms
        _res(3, None, 0.01, 0, success=False, prompt_len=1000, error="HTTP 500: boom"),
    ]
    unfinished = RequestResult(4, 10, 10)  # cut off by an interrupt
    m = compute_metrics(results + [unfinished], 2.0, [50, 99], {"ttft": 200, "tpot": 80})
    assert (m["completed"], m["failed"], m["incomplete"]) == (3, 1, 1)
    assert m["total_input_tokens"] == 350  # failed requests do not count
    assert m["total_output_tokens"] == 30
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["input_throughput"] == pytest.approx(175.0)
    assert m["output_throughput"] == pytest.approx(15.0)
    assert m["total_token_throughput"] == pytest.approx(190.0)
    assert m["good_requests"] == 1  # only request 2 meets both ttft<=200 and tpot<=80
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["ttft_ms"]["median"] == pytest.approx(100.0)
    assert m["e2el_ms"]["p50"] == pytest.approx(1000.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100 + 100 + 50) / 3)
    assert m["itl_ms"]["mean"] == pytest.approx((0.1 * 18 + 0.05 * 9) / 27 * 1e3)
    assert m["errors"] == [{"error": "HTTP 500: boom", "count": 1}]
    no_slo = compute_metrics(results, 2.0)
    assert no_slo["request_goodput"] is None
    assert serve.format_report(m)  # renders
    # usage-reported prompt tokens win over the nominal length
    r = _res(0, 0.1, 0.2, 2, prompt_len=10)
    r.usage_prompt_tokens = 17
    assert compute_metrics([r], 1.0)["total_input_tokens"] == 17


# ------------------------------------------------------------------------- SSE


def test_sse_data_lines_blank_lines_comments_and_done():
    lines = [
        ": keep-alive comment",
        "",
        'data: {"a": 1}',
        "",
        "event: message",
        "id: 7",
        'data:{"a": 2}',  # no space after the colon is valid too
        "",
        "",
        "data: [DONE]",
        "",
        'data: {"a": 3}',  # after [DONE]: ignored
        "",
    ]
    assert list(iter_sse_data(lines)) == ['{"a": 1}', '{"a": 2}', "[DONE]"]


def test_sse_multiline_and_unterminated_events():
    d = SSEDecoder()
    assert d.feed('data: {"x":') == []
    assert d.feed("data: 1}") == []
    assert d.feed("\r\n") == ['{"x":\n1}']
    assert decode_payload('{"x":\n1}') == [{"x": 1}]
    # no blank line at the end of the stream: flushed
    assert list(iter_sse_data(['data: {"b": 1}'])) == ['{"b": 1}']
    # a server that forgot the blank lines between events
    joined = list(iter_sse_data(['data: {"c": 1}', 'data: {"c": 2}']))
    assert len(joined) == 1 and decode_payload(joined[0]) == [{"c": 1}, {"c": 2}]
    with pytest.raises(json.JSONDecodeError):
        decode_payload("{not json")
    assert decode_payload("   ") == []


def test_chunk_content_and_errors():
    comp = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
    chat = {"choices": [{"index": 0, "delta": {"content": "yo"}}]}
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    assert serve.chunk_content(comp, chat=False) == "hi"
    assert serve.chunk_content(chat, chat=True) == "yo"
    assert serve.chunk_content(role, chat=True) == ""
    assert serve.chunk_content(usage, chat=False) == ""
    assert serve.error_message(comp) is None
    assert serve.error_message({"error": {"message": "bad", "type": "x"}}) == "bad"
    assert serve.error_message({"object": "error", "message": "nope"}) == "nope"
    assert serve.error_message({"detail": "Not Found"}) == "Not Found"
    assert serve.http_error_text(400, b'{"error": {"message": "too long"}}') == "HTTP 400: too long"
    assert serve.http_error_text(502, b"Bad Gateway") == "HTTP 502: Bad Gateway"
    assert serve.http_error_text(500, b"") == "HTTP 500: (empty body)"


# -------------------------------------------------------------------- datasets


def test_synthetic_requests_deterministic_and_in_range():
    a = synthetic_requests(20, chat=False, input_len_range=(5, 9), output_len_range=(2, 4),
                           min_token_id=10, max_token_id=12, seed=3)
    b = synthetic_requests(20, chat=False, input_len_range=(5, 9), output_len_range=(2, 4),
                           min_token_id=10, max_token_id=12, seed=3)
    assert a == b
    assert a != synthetic_requests(20, chat=False, input_len_range=(5, 9),
                                   output_len_range=(2, 4), min_token_id=10,
                                   max_token_id=12, seed=4)
    for s in a:
        assert 5 <= s.prompt_len <= 9 and len(s.prompt) == s.prompt_len
        assert 2 <= s.output_len <= 4
        assert all(isinstance(t, int) and 10 <= t <= 12 for t in s.prompt)
    assert {s.prompt_len for s in a} == set(range(5, 10))  # inclusive bounds
    chat = synthetic_requests(3, chat=True, input_len=12, output_len=7)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 12 for s in chat)
    assert parse_range("3:8") == (3, 8)
    for bad in ("3", "8:3", "0:4", "a:b"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_arrival_offsets():
    assert np.all(arrival_offsets(5, math.inf) == 0)
    off = arrival_offsets(4000, 10.0, 1.0, seed=1)
    assert off[0] == 0 and np.all(np.diff(off) >= 0)
    assert np.mean(np.diff(off)) == pytest.approx(0.1, rel=0.08)
    bursty = np.diff(arrival_offsets(4000, 10.0, 0.25, seed=1))
    assert np.mean(bursty) == pytest.approx(0.1, rel=0.15)
    assert np.std(bursty) > 1.5 * np.std(np.diff(off))  # burstier = more spread
    assert np.array_equal(arrival_offsets(10, 5.0, seed=2), arrival_offsets(10, 5.0, seed=2))


# ------------------------------------------------------- in-process SSE server

TTFT_S = 0.060  # server delay before the first token
ITL_S = 0.015  # server delay between tokens
CHAT_TEMPLATE_TOKENS = 5


def _make_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        model = body.get("model")
        if model == "reject":
            return JSONResponse(
                {"error": {"message": "model 'reject' does not exist", "type": "NotFound"}},
                status_code=404)
        n = int(body["max_tokens"])
        if chat:
            prompt_tokens = len(body["messages"][0]["content"].split()) + CHAT_TEMPLATE_TOKENS
        else:
            prompt_tokens = len(body["prompt"])

        def chunk(text: str, finish=None) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return f"data: {json.dumps({'object': 'chunk', 'choices': [choice]})}\n\n"

        async def gen():
            state["active"] += 1
            state["peak"] = max(state["peak"], state["active"])
            try:
                yield ": keep-alive\n\n"
                if chat:  # role-only first delta: no content, must not count as TTFT
                    yield ('data: {"choices": [{"index": 0, "delta": {"role": "assistant",'
                           ' "content": ""}}]}\n\n')
                await asyncio.sleep(5.0 if model == "slow" else TTFT_S)
                for i in range(n):
                    if i:
                        await asyncio.sleep(ITL_S)
                    yield chunk(f" t{i}", "length" if i == n - 1 else None)
                    if model == "midstream-error":
                        yield 'data: {"error": {"message": "worker died", "code": 500}}\n\n'
                        return
                if body.get("stream_options", {}).get("include_usage") and not state["no_usage"]:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                             "total_tokens": prompt_tokens + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["active"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def sse_server():
    import uvicorn

    state: dict = {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(state), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 15
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("test SSE server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def server(sse_server):
    url, state = sse_server
    state.update(bodies=[], active=0, peak=0, no_usage=False)
    return url, state


def _run(argv: list[str]) -> int:
    parser = serve.build_parser()
    return serve.main(parser.parse_args(argv + ["--no-progress"]))


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


def test_output_tokens_without_usage_chunk(server, tmp_path):
    url, state = server
    state["no_usage"] = True
    out = tmp_path / "r.json"
    rc = _run(["--base-url", url, "--model", "m", "--num-prompts", "3", "--input-len", "5",
               "--output-len", "6", "--result-json", str(out), "--save-text"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["metrics"]["total_output_tokens"] == 18  # counted content chunks
    assert doc["metrics"]["total_input_tokens"] == 15  # nominal prompt length
    row = doc["requests"][0]
    assert row["usage_output_tokens"] is None and row["generated_text"].startswith(" t0 t1")


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
    cfg = serve.BenchConfig(base_url=url, model="tiny-model", max_concurrency=2)
    specs = synthetic_requests(20, chat=False, input_len=4, output_len=10)

    async def go():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        return await serve.run_benchmark(cfg, specs, stop=stop)

    state = asyncio.run(go())
    assert state.interrupted and 0.1 < state.duration < 2.0  # stopped at ~0.5 s, not run out
    m = compute_metrics(state.results, state.duration)
    assert m["completed"] >= 2 and m["incomplete"] >= 1
    assert m["completed"] + m["failed"] + m["incomplete"] == len(state.results) == 20


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_prints_partial_results(server, tmp_path):
    url, state = server
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.serve", "--base-url", url, "--num-prompts", "40",
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
