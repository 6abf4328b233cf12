"""Per-request results of ``tandem bench serve`` and the math over them: TPOT,
percentile summaries, SLO checks, throughput and goodput. Torch-free (numpy).

Definitions (all per successful request; times in ms in the report):
  * TTFT: from sending the request to the first chunk carrying non-empty content.
  * ITL: gaps between successive content chunks (pooled over all requests).
  * TPOT: (e2e - ttft) / (output_tokens - 1); undefined for a single token (left
    out of the TPOT statistics, and counted as meeting a TPOT SLO).
  * E2E: from sending the request to its last content chunk (as vLLM: not the
    usage chunk or ``[DONE]`` after it; the end of the stream if none came).
  * output tokens: ``usage.completion_tokens`` from the final usage chunk when the
    server sends one; else max_tokens for a ``length`` finish (``ignore_eos`` is
    sent); else the number of content chunks, flagged as an estimate (a chunk may
    carry several tokens).
  * peak concurrency: the most requests in flight at once, from their start
    times and latencies (across client processes too).
  * goodput: successful requests meeting every given SLO, per second of duration.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; ``start`` is relative to the
    benchmark start. ``finished`` is False for a request cut off by Ctrl-C."""

    index: int
    prompt_len: int
    output_len: int  # requested max_tokens
    start: float = 0.0
    finished: bool = False
    success: bool = False
    error: str = ""
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    content_chunks: int = 0
    last_token_at: float | None = None  # seconds after the request was sent
    received: float | None = None  # seconds after the request was sent: its response's last byte (or its failure)
    output_tokens: int = 0
    output_tokens_estimated: bool = False  # no usage and not a length finish: content chunks counted
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    finish_reason: str | None = None
    generated_text: str = ""
    usage_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    token_ids: list[int] = field(default_factory=list)  # the output's ids, when the server sends them (return_token_ids)

    @property
    def tpot(self) -> float | None:
        return tpot_seconds(self.latency, self.ttft, self.output_tokens)

    @property
    def input_tokens(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len


def tpot_seconds(latency: float | None, ttft: float | None, output_tokens: int) -> float | None:
    """(e2e - ttft) / (output_tokens - 1); ``None`` with fewer than 2 tokens."""
    if latency is None or ttft is None or output_tokens < 2:
        return None
    return (latency - ttft) / (output_tokens - 1)


def parse_percentiles(text: str) -> list[float]:
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        p = float(part)
        if not 0 < p <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {part}")
        out.append(p)
    if not out:
        raise ValueError("no percentiles given")
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (ms)."""
    slos: dict[str, float] = {}
    for item in items or ():
        for piece in item.replace(",", " ").split():
            name, sep, value = piece.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(
                    f"bad goodput SLO {piece!r}: use NAME:MS with NAME in {', '.join(SLO_METRICS)}"
                )
            ms = float(value)
            if not ms > 0:
                raise ValueError(f"goodput SLO {piece!r} must be > 0 ms")
            slos[name] = ms
    return slos


def pct_key(p: float) -> str:
    return f"p{p:g}"


def summarize(values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean / median / std / min / max and the given percentiles (linear
    interpolation, like numpy's default); ``None`` everywhere when empty."""
    keys = ["mean", "median", "std", "min", "max"] + [pct_key(p) for p in percentiles]
    if len(values_ms) == 0:
        return {k: None for k in keys}
    arr = np.asarray(values_ms, dtype=np.float64)
    out: dict[str, float | None] = {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }
    for p, v in zip(percentiles, np.percentile(arr, list(percentiles))):
        out[pct_key(p)] = float(v)
    return out


def meets_slos(res: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (ms). A one-token request has
    no TPOT and counts as meeting a TPOT SLO (as in vLLM)."""
    if not res.success:
        return False
    values = {
        "ttft": (res.ttft or 0.0) * 1e3,
        "tpot": (res.tpot or 0.0) * 1e3,
        "e2el": (res.latency or 0.0) * 1e3,
    }
    return all(values[name] <= limit for name, limit in slos.items())


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
    slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Aggregate metrics over finished requests (unfinished ones, cut off by an
    interrupt, are only counted as ``incomplete``). Latencies in ms."""
    finished = [r for r in results if r.finished]
    ok = [r for r in finished if r.success]
    failed = [r for r in finished if not r.success]
    dur = duration_s if duration_s > 0 else float("nan")
    in_tok = sum(r.input_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)

    def rate(x: float) -> float:
        return x / dur if duration_s > 0 else 0.0

    m: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "incomplete": len(results) - len(finished),
        "total_input_tokens": int(in_tok),
        "total_output_tokens": int(out_tok),
        "request_throughput": rate(len(ok)),
        "input_throughput": rate(in_tok),
        "output_throughput": rate(out_tok),
        "total_token_throughput": rate(in_tok + out_tok),
        "percentiles": list(percentiles),
    }
    samples = {
        "ttft": [r.ttft * 1e3 for r in ok if r.ttft is not None],
        "tpot": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl": [x * 1e3 for r in ok for x in r.itl],
        "e2el": [r.latency * 1e3 for r in ok if r.latency is not None],
    }
    for name in LATENCY_METRICS:
        m[f"{name}_ms"] = summarize(samples[name], percentiles)
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        m["goodput_slos_ms"] = dict(slos)
        m["good_requests"] = int(good)
        m["request_goodput"] = rate(good)
    else:
        m["goodput_slos_ms"] = None
        m["good_requests"] = None
        m["request_goodput"] = None
    errors = Counter(r.error for r in failed)
    m["errors"] = [{"error": e, "count": c} for e, c in errors.most_common()]
    m["output_tokens_estimated"] = sum(r.output_tokens_estimated for r in ok)
    m["peak_concurrency"] = peak_concurrency(finished)  # one rule for one client process or several
    for name in LATENCY_METRICS:  # vLLM's flat keys too (mean_ttft_ms, p99_itl_ms, ...), for its tools
        for key, value in m[f"{name}_ms"].items():
            m[f"{key}_{name}_ms"] = value
    return m


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once, from their start times and latencies."""
    edges = sorted([(r.start, 1) for r in results if r.latency is not None]
                   + [(r.start + r.latency, -1) for r in results if r.latency is not None],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = current = 0
    for _t, step in edges:
        current += step
        peak = max(peak, current)
    return peak
