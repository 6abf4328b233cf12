"""Tests for the metric math of ``tandem bench serve`` (bench/serve_metrics.py) and
that the report (bench/serve_report.py) renders."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.bench.serve_metrics import (
    RequestResult,
    compute_metrics,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    summarize,
    tpot_seconds,
)
from tandem.bench.serve_report import format_report


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
    assert format_report(m)  # renders
    # usage-reported prompt tokens win over the nominal length
    r = _res(0, 0.1, 0.2, 2, prompt_len=10)
    r.usage_prompt_tokens = 17
    assert compute_metrics([r], 1.0)["total_input_tokens"] == 17
