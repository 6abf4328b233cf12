"""How ``tandem bench serve`` counts a stream against the SSE server of conftest.py: output
tokens with and without a usage chunk, an answer whose text is empty, where E2E latency and
the run's duration end, a malformed chunk."""

from __future__ import annotations

import json
import time

import pytest

from tests.bench.conftest import ITL_S, TTFT_S, run_serve as _run


def test_output_tokens_without_usage_chunk(server, tmp_path):
    url, state = server
    state["no_usage"] = True
    out = tmp_path / "r.json"
    rc = _run(["--base-url", url, "--model", "m", "--num-prompts", "3", "--input-len", "5",
               "--output-len", "6", "--result-json", str(out), "--save-text"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["metrics"]["total_output_tokens"] == 18  # a length finish: max_tokens each
    assert doc["metrics"]["total_input_tokens"] == 15  # nominal prompt length
    row = doc["requests"][0]
    assert row["usage_output_tokens"] is None and row["generated_text"].startswith(" t t")


@pytest.mark.parametrize("model, tokens, estimated", [("two-per-chunk", 8, 0), ("stop-early", 3, 1)])
def test_tokens_without_usage_when_a_chunk_carries_several(server, tmp_path, capsys, model, tokens, estimated):
    """A length finish means max_tokens were generated; an early stop without usage can only
    count chunks, and the report says so."""
    url, state = server
    state["no_usage"] = True
    out = tmp_path / "r.json"
    assert _run(["--base-url", url, "--model", model, "--num-prompts", "1", "--input-len", "5",
                 "--output-len", "8", "--result-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["requests"][0]["output_tokens"] == tokens
    assert doc["metrics"]["output_tokens_estimated"] == estimated
    assert ("counted as content chunks" in capsys.readouterr().out) == bool(estimated)


def test_an_answer_whose_text_is_empty_is_served_not_failed(server, tmp_path):
    """Tokens that all decode to empty text (a server sends no chunk for them, only the one with
    the finish reason): the request succeeded, its tokens come from usage, its first token's
    time is the finishing chunk's."""
    url, state = server
    out = tmp_path / "r.json"
    assert _run(["--base-url", url, "--model", "empty-text", "--num-prompts", "2", "--input-len", "5",
                 "--output-len", "4", "--result-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["metrics"]["completed"] == 2 and doc["metrics"]["failed"] == 0
    row = doc["requests"][0]
    assert row["success"] and row["error"] in (None, "") and row["output_tokens"] == 4
    assert row["ttft_ms"] >= TTFT_S * 1e3


def test_e2e_latency_ends_at_the_last_token(server, tmp_path):
    """Not at the usage chunk or [DONE] after it (vLLM's definition)."""
    url, _ = server
    out = tmp_path / "r.json"
    assert _run(["--base-url", url, "--model", "late-usage", "--num-prompts", "1", "--input-len", "5",
                 "--output-len", "4", "--result-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    row = doc["requests"][0]
    assert row["output_tokens"] == 4  # the usage still counted
    assert row["e2el_ms"] < (TTFT_S + 3 * ITL_S + 0.2) * 1e3  # the 0.3 s before the usage chunk left out
    assert doc["metrics"]["mean_e2el_ms"] == doc["metrics"]["e2el_ms"]["mean"]  # vLLM's flat keys too


def test_duration_ends_at_the_last_byte_not_after_the_clients_decoding(server, tmp_path, monkeypatch):
    """The client decodes a stream's events after it ends; that is the client's time, not the
    server's, and the run's duration (and so its throughput) leaves it out."""
    from tandem.bench import serve_request

    replay = serve_request._replay

    def slow_replay(*args, **kwargs):
        time.sleep(0.5)
        return replay(*args, **kwargs)

    monkeypatch.setattr(serve_request, "_replay", slow_replay)
    url, _ = server
    out = tmp_path / "r.json"
    assert _run(["--base-url", url, "--num-prompts", "2", "--max-concurrency", "1", "--input-len", "5",
                 "--output-len", "4", "--result-json", str(out)]) == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["completed"] == 2
    served = 2 * (TTFT_S + 3 * ITL_S)
    # the second request waited for the first one's decoding (0.5 s), but not for its own
    assert served + 0.5 <= m["duration_s"] < served + 0.5 + 0.4


def test_a_malformed_chunk_fails_its_request_not_the_run(server, tmp_path):
    url, _ = server
    out = tmp_path / "r.json"
    assert _run(["--base-url", url, "--endpoint", "chat", "--model", "bad-chunk", "--num-prompts", "2",
                 "--input-len", "5", "--output-len", "4", "--result-json", str(out)]) == 1  # none succeeded
    m = json.loads(out.read_text())["metrics"]
    assert (m["completed"], m["failed"]) == (0, 2) and "AttributeError" in m["errors"][0]["error"]
