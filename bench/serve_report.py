"""What ``tandem bench serve`` prints and saves: the text report of the aggregate
metrics (:func:`bench.serve_metrics.compute_metrics`) and the per-request rows of
``--result-json``.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.bench.serve_metrics import LATENCY_METRICS, RequestResult, meets_slos, pct_key
from tandem.bench.serve_request import BenchConfig

METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}"


def format_report(m: dict[str, Any], cfg: BenchConfig | None = None, peak: int | None = None) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value!s:>10}")

    if cfg is not None:
        lines.append(f"{'Endpoint:':<16}{cfg.url}")
        lines.append(f"{'Model:':<16}{cfg.model}")
        rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
        row("Request rate (req/s):", rate)
        row("Burstiness:", f"{cfg.burstiness:g}")
        row("Max concurrency:", cfg.max_concurrency or "none")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m["incomplete"]:
        row("Incomplete (interrupted):", m["incomplete"])
    if peak is not None:
        row("Peak concurrent requests:", peak)
    row("Benchmark duration (s):", _fmt(m["duration_s"]))
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    if m.get("output_tokens_estimated"):
        lines.append(f"  ({m['output_tokens_estimated']} requests sent no usage and stopped early: their tokens")
        lines.append("   are counted as content chunks, a lower bound that also skews TPOT)")
    row("Request throughput (req/s):", _fmt(m["request_throughput"]))
    if m["request_goodput"] is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in m["goodput_slos_ms"].items())
        row("Request goodput (req/s):", _fmt(m["request_goodput"]))
        row(f"  good requests ({slos} ms):", m["good_requests"])
    row("Input token throughput (tok/s):", _fmt(m["input_throughput"]))
    row("Output token throughput (tok/s):", _fmt(m["output_throughput"]))
    row("Total token throughput (tok/s):", _fmt(m["total_token_throughput"]))
    abbrev = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
    for name in LATENCY_METRICS:
        stats = m[f"{name}_ms"]
        lines.append("{s:{c}^{n}}".format(s=f" {METRIC_TITLES[name]} ", n=w, c="-"))
        a = abbrev[name]
        row(f"Mean {a} (ms):", _fmt(stats["mean"]))
        row(f"Median {a} (ms):", _fmt(stats["median"]))
        for p in m["percentiles"]:
            if p != 50:  # that is the median, printed above
                row(f"P{p:g} {a} (ms):", _fmt(stats[pct_key(p)]))
    if m["errors"]:
        lines.append("{s:{c}^{n}}".format(s=" Errors ", n=w, c="-"))
        for e in m["errors"][:5]:
            lines.append(f"{e['count']:>6} x {e['error'][:200]}")
        if len(m["errors"]) > 5:
            lines.append(f"   ... and {len(m['errors']) - 5} more distinct errors")
    lines.append("=" * w)
    return "\n".join(lines)


def request_row(r: RequestResult, slos: dict[str, float] | None) -> dict[str, Any]:
    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1e3

    row = {
        "index": r.index,
        "finished": r.finished,
        "success": r.success,
        "error": r.error or None,
        "start_s": r.start,
        "prompt_len": r.prompt_len,
        "input_tokens": r.input_tokens,
        "max_tokens": r.output_len,
        "output_tokens": r.output_tokens,
        "content_chunks": r.content_chunks,
        "output_tokens_estimated": r.output_tokens_estimated,
        "usage_output_tokens": r.usage_output_tokens,
        "finish_reason": r.finish_reason,
        "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot),
        "e2el_ms": ms(r.latency),
        "itl_ms": [x * 1e3 for x in r.itl],
    }
    if slos:
        row["meets_slos"] = meets_slos(r, slos)
    if r.generated_text:
        row["generated_text"] = r.generated_text
    return row


def json_safe(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
