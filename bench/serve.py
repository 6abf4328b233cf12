"""``tandem bench serve``: a streaming load client for an OpenAI-compatible server.

In the manner of ``vllm bench serve``, torch-free (httpx async + numpy). It sends
synthetic random prompts to ``/v1/completions`` (token-id prompts, so the prompt
length is exact) or ``/v1/chat/completions`` (random words), always streaming with
``ignore_eos`` and ``stream_options.include_usage``, at a Poisson/Gamma request
rate and/or under a concurrency cap, and reports throughput, TTFT / TPOT / ITL /
E2E latency statistics and goodput under SLOs.

Usage::

    tandem bench serve --base-url http://127.0.0.1:8000 --endpoint completions \\
        --num-prompts 200 --input-len 512 --output-len 128 \\
        --request-rate 8 --max-concurrency 32 --goodput ttft:200 tpot:50 \\
        --result-json out/bench.json

    python -m bench.serve ...          # same, without the ``tandem`` entry point

Definitions (all per successful request; times in ms in the report):
  * TTFT: from sending the request to the first chunk carrying non-empty content.
  * ITL: gaps between successive content chunks (pooled over all requests).
  * TPOT: (e2e - ttft) / (output_tokens - 1); undefined for a single token (left
    out of the TPOT statistics, and counted as meeting a TPOT SLO).
  * E2E: from sending the request to the end of the stream.
  * output tokens: ``usage.completion_tokens`` from the final usage chunk when the
    server sends one, else the number of content chunks.
  * goodput: successful requests meeting every given SLO, per second of duration.

Exit status of :func:`main`: 0 when at least one request succeeded, 1 when none
did, 2 on a usage/setup error (bad arguments, model lookup failed), 130 when
interrupted (Ctrl-C prints and saves the partial results first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import httpx
import numpy as np

from bench.datasets import RequestSpec, arrival_offsets, parse_range, synthetic_requests

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
DONE = "[DONE]"


# --------------------------------------------------------------------------- SSE


class SSEDecoder:
    """Incremental ``text/event-stream`` decoder: feed it lines (without their line
    ending), get back the ``data`` payload of each completed event.

    Comment lines (``:...``) and other fields (``event:``, ``id:``, ``retry:``) are
    ignored; consecutive ``data:`` lines of one event are joined with ``\\n`` as the
    spec says, and a blank line ends the event. Call :meth:`flush` at the end of the
    stream for an event that was not followed by a blank line.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> list[str]:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return []
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return []

    def flush(self) -> list[str]:
        if not self._data:
            return []
        data = "\n".join(self._data)
        self._data = []
        return [data]


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` payloads of an SSE stream given as lines (ends at ``[DONE]``,
    which is yielded too)."""
    decoder = SSEDecoder()
    for line in lines:
        for data in decoder.feed(line):
            yield data
            if data.strip() == DONE:
                return
    yield from decoder.flush()


def decode_payload(data: str) -> list[Any]:
    """JSON objects of one event's data. A server that forgot the blank line between
    events makes several ``data:`` lines join into one event; split them back."""
    data = data.strip()
    if not data:
        return []
    try:
        return [json.loads(data)]
    except json.JSONDecodeError:
        if "\n" not in data:
            raise
        out: list[Any] = []
        for part in data.split("\n"):
            part = part.strip()
            if part and part != DONE:
                out.append(json.loads(part))
        return out


def error_message(obj: Any) -> str | None:
    """The message of an OpenAI-style error object (``{"error": {...}}``,
    ``{"object": "error", "message": ...}``, FastAPI's ``{"detail": ...}``), or
    ``None`` when ``obj`` is not an error."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if err:
        if isinstance(err, dict):
            return str(err.get("message") or err.get("type") or json.dumps(err))
        return str(err)
    if obj.get("object") == "error":
        return str(obj.get("message") or json.dumps(obj))
    if "detail" in obj and "choices" not in obj:
        detail = obj["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)
    return None


def chunk_content(obj: dict, chat: bool) -> str:
    """The generated text in one streamed chunk (all choices concatenated)."""
    parts: list[str] = []
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if chat:
            delta = choice.get("delta") or {}
            for key in ("content", "reasoning_content", "reasoning"):
                value = delta.get(key)
                if isinstance(value, str) and value:
                    parts.append(value)
        else:
            value = choice.get("text")
            if isinstance(value, str) and value:
                parts.append(value)
    return "".join(parts)


def http_error_text(status: int, body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        msg = error_message(json.loads(text)) if text else None
    except json.JSONDecodeError:
        msg = None
    msg = msg or text[:500] or "(empty body)"
    return f"HTTP {status}: {msg}"


# ---------------------------------------------------------------------- requests


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
    output_tokens: int = 0
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    finish_reason: str | None = None
    generated_text: str = ""

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


@dataclass
class BenchConfig:
    base_url: str
    endpoint: str = "completions"
    model: str = ""
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    request_timeout: float = 600.0
    temperature: float = 0.0
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    seed: int = 0
    keep_text: bool = False
    progress: bool = False

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    @property
    def url(self) -> str:
        return api_root(self.base_url) + ENDPOINT_PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def api_root(base_url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all mean the same server."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def build_payload(cfg: BenchConfig, spec: RequestSpec) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": cfg.model}
    if cfg.chat:
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    payload.update(
        max_tokens=spec.output_len,
        temperature=cfg.temperature,
        stream=True,
        stream_options={"include_usage": True},
        ignore_eos=True,
    )
    payload.update(cfg.extra_body)
    return payload


async def _stream_request(
    client: httpx.AsyncClient, cfg: BenchConfig, spec: RequestSpec, res: RequestResult
) -> None:
    """Send one streaming request, filling ``res`` as chunks arrive."""
    payload = build_payload(cfg, spec)
    t0 = time.perf_counter()
    last = t0
    text: list[str] = []
    async with client.stream("POST", cfg.url, json=payload, headers=cfg.headers()) as resp:
        if resp.status_code != 200:
            res.error = http_error_text(resp.status_code, await resp.aread())
            res.latency = time.perf_counter() - t0
            return
        decoder = SSEDecoder()
        done = False

        def handle(data: str) -> bool:
            """Returns True at the end of the stream."""
            nonlocal last
            now = time.perf_counter()
            if data.strip() == DONE:
                return True
            for obj in decode_payload(data):
                if not isinstance(obj, dict):
                    continue
                msg = error_message(obj)
                if msg is not None:
                    raise _StreamError(msg)
                content = chunk_content(obj, cfg.chat)
                if content:
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.content_chunks += 1
                    if cfg.keep_text:
                        text.append(content)
                for choice in obj.get("choices") or ():
                    if isinstance(choice, dict) and choice.get("finish_reason"):
                        res.finish_reason = str(choice["finish_reason"])
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    if usage.get("completion_tokens") is not None:
                        res.usage_output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        res.usage_prompt_tokens = int(usage["prompt_tokens"])
            return False

        async for line in resp.aiter_lines():
            for data in decoder.feed(line):
                done = handle(data) or done
            if done:
                break
        if not done:
            for data in decoder.flush():
                handle(data)
    res.latency = time.perf_counter() - t0
    res.generated_text = "".join(text)
    res.output_tokens = (
        res.usage_output_tokens if res.usage_output_tokens is not None else res.content_chunks
    )
    if res.ttft is None:
        res.error = "stream ended without any generated content"
        return
    res.success = True


class _StreamError(Exception):
    pass


async def send_request(
    client: httpx.AsyncClient, cfg: BenchConfig, spec: RequestSpec, res: RequestResult
) -> RequestResult:
    """One request under ``cfg.request_timeout`` (a bound on the whole request,
    not only on each read); every failure lands in ``res.error``."""
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_stream_request(client, cfg, spec, res), cfg.request_timeout)
    except asyncio.TimeoutError:
        res.success = False
        res.error = f"timed out after {cfg.request_timeout:g} s"
    except httpx.TimeoutException as exc:
        res.success = False
        res.error = f"timed out ({type(exc).__name__}) after {cfg.request_timeout:g} s"
    except _StreamError as exc:
        res.success = False
        res.error = f"error in stream: {exc}"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError, OSError) as exc:
        res.success = False
        res.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if res.latency is None or not res.success:
        res.latency = time.perf_counter() - t0
    res.finished = True
    return res


# --------------------------------------------------------------------- benchmark


@dataclass
class BenchState:
    """Shared with the caller so that results survive an interrupt."""

    results: list[RequestResult] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    interrupted: bool = False
    in_flight: int = 0
    peak_concurrency: int = 0

    @property
    def duration(self) -> float:
        if self.start is None:
            return 0.0
        end = self.end if self.end is not None else time.perf_counter()
        return max(end - self.start, 0.0)


async def fetch_model(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The first model id of ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        resp = await client.get(api_root(base_url) + "/v1/models", headers=headers)
        if resp.status_code != 200:
            raise RuntimeError(http_error_text(resp.status_code, resp.content))
        data = resp.json().get("data") or []
        if not data or "id" not in data[0]:
            raise RuntimeError("GET /v1/models listed no models")
        return str(data[0]["id"])


async def run_benchmark(
    cfg: BenchConfig,
    specs: Sequence[RequestSpec],
    state: BenchState | None = None,
    stop: asyncio.Event | None = None,
) -> BenchState:
    """Send ``specs`` at ``cfg.request_rate`` (gamma arrivals) with at most
    ``cfg.max_concurrency`` in flight. Setting ``stop`` (Ctrl-C does, when this
    runs in the main thread) stops sending, cancels what is in flight and returns
    the partial state with ``interrupted`` set."""
    state = state if state is not None else BenchState()
    stop = stop if stop is not None else asyncio.Event()
    offsets = arrival_offsets(len(specs), cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.request_timeout)

    loop = asyncio.get_running_loop()
    sigint_installed = False

    def on_sigint() -> None:
        stop.set()
        # A second Ctrl-C gets Python's default handler (KeyboardInterrupt).
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        sigint_installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        pass  # not the main thread / no signal support: the caller handles it

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def one(spec: RequestSpec, res: RequestResult) -> None:
            if sem is not None:
                await sem.acquire()
            try:
                res.start = time.perf_counter() - (state.start or 0.0)
                state.in_flight += 1
                state.peak_concurrency = max(state.peak_concurrency, state.in_flight)
                try:
                    await send_request(client, cfg, spec, res)
                finally:
                    state.in_flight -= 1
            finally:
                if sem is not None:
                    sem.release()

        async def dispatch() -> None:
            tasks: list[asyncio.Task] = []
            try:
                for spec, offset in zip(specs, offsets):
                    delay = state.start + float(offset) - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    res = RequestResult(spec.index, spec.prompt_len, spec.output_len)
                    state.results.append(res)
                    tasks.append(asyncio.create_task(one(spec, res)))
                await asyncio.gather(*tasks)
            finally:
                # Interrupted (possibly while waiting for the next arrival): cancel
                # what is in flight and wait for it, so nothing outlives the client.
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        progress_task = asyncio.create_task(_progress(state, len(specs))) if cfg.progress else None
        state.start = time.perf_counter()
        run_task = asyncio.create_task(dispatch())
        stop_task = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if not run_task.done():
                state.interrupted = True
                run_task.cancel()
            state.end = time.perf_counter()
            try:
                await run_task
            except asyncio.CancelledError:
                if not state.interrupted:
                    raise
        finally:
            if state.end is None:
                state.end = time.perf_counter()
            stop_task.cancel()
            if progress_task is not None:
                progress_task.cancel()
            if sigint_installed:
                try:
                    loop.remove_signal_handler(signal.SIGINT)
                except (NotImplementedError, RuntimeError, ValueError):
                    pass
            if progress_task is not None:
                _progress_line(state, len(specs))
                sys.stderr.write("\n")
    return state


def _progress_line(state: BenchState, total: int) -> None:
    done = sum(r.finished for r in state.results)
    ok = sum(r.success for r in state.results)
    sys.stderr.write(
        f"\r  {done}/{total} done ({ok} ok), {state.in_flight} in flight, "
        f"{state.duration:7.1f} s "
    )
    sys.stderr.flush()


async def _progress(state: BenchState, total: int) -> None:
    while True:
        _progress_line(state, total)
        await asyncio.sleep(0.5)


# ----------------------------------------------------------------------- metrics


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
    return m


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


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# --------------------------------------------------------------------------- CLI


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench serve`` (also ``python -m bench.serve``)."""
    g = parser.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, e.g. http://host:port (a trailing /v1 is fine)")
    g.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions",
                   help="completions -> /v1/completions (token-id prompts), "
                        "chat -> /v1/chat/completions (random-word prompts)")
    g.add_argument("--model", default=None,
                   help="model name to send (default: first id from GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")

    g = parser.add_argument_group("load shape")
    g.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send")
    g.add_argument("--request-rate", type=_positive_float, default=math.inf,
                   help="mean requests/s with gamma-distributed gaps; inf (default) "
                        "sends all at once")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, "
                        ">1 more regular")
    g.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="at most this many requests in flight")
    g.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds allowed for one whole request (default 600)")

    g = parser.add_argument_group("synthetic prompts")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--input-len", type=_positive_int, default=1024,
                   help="prompt tokens per request (default 1024)")
    x.add_argument("--input-len-range", type=_range, default=None, metavar="A:B",
                   help="prompt tokens uniform in [A, B]")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--output-len", type=_positive_int, default=128,
                   help="max_tokens per request, sent with ignore_eos (default 128)")
    x.add_argument("--output-len-range", type=_range, default=None, metavar="A:B",
                   help="max_tokens uniform in [A, B]")
    g.add_argument("--min-token-id", type=int, default=10,
                   help="smallest random prompt token id (completions; default 10)")
    g.add_argument("--max-token-id", type=int, default=1000,
                   help="largest random prompt token id (completions; default 1000)")
    g.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths and arrivals")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body")

    g = parser.add_argument_group("report")
    g.add_argument("--percentiles", default="50,90,99",
                   help="comma-separated percentiles to report (default 50,90,99)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000 (ms)")
    g.add_argument("--result-json", default=None, metavar="PATH",
                   help="write all metrics, the config and per-request rows here")
    g.add_argument("--save-text", action="store_true",
                   help="keep the generated text in the per-request rows")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stderr is a terminal)")


def _config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, list[float], dict[str, float]]:
    extra: dict = {}
    if args.extra_body:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    if not 0 <= args.min_token_id <= args.max_token_id:
        raise ValueError("need 0 <= --min-token-id <= --max-token-id")
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    cfg = BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model or "",
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        request_timeout=args.request_timeout,
        temperature=args.temperature,
        api_key=args.api_key,
        extra_body=extra,
        seed=args.seed,
        keep_text=args.save_text,
        progress=progress,
    )
    return cfg, parse_percentiles(args.percentiles), parse_goodput(args.goodput)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; print the report, write
    ``--result-json``; return the exit status (see the module docstring)."""
    try:
        cfg, percentiles, slos = _config_from_args(args)
        specs = synthetic_requests(
            args.num_prompts,
            chat=cfg.chat,
            input_len=args.input_len,
            input_len_range=args.input_len_range,
            output_len=args.output_len,
            output_len_range=args.output_len_range,
            min_token_id=args.min_token_id,
            max_token_id=args.max_token_id,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 2

    if not cfg.model:
        try:
            cfg.model = asyncio.run(
                fetch_model(cfg.base_url, cfg.api_key, timeout=min(30.0, cfg.request_timeout))
            )
        except (httpx.HTTPError, RuntimeError, ValueError, OSError) as exc:
            print(f"bench serve: cannot get the model from {api_root(cfg.base_url)}/v1/models "
                  f"({type(exc).__name__}: {exc}); pass --model", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130

    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    print(f"bench serve: {len(specs)} requests to {cfg.url} (model {cfg.model}), "
          f"request rate {rate}/s, burstiness {cfg.burstiness:g}, "
          f"max concurrency {cfg.max_concurrency or 'none'}", flush=True)

    state = BenchState()
    try:
        asyncio.run(run_benchmark(cfg, specs, state))
    except KeyboardInterrupt:
        # No signal handler could be installed (or a second Ctrl-C): report what we have.
        state.interrupted = True
        if state.end is None and state.start is not None:
            state.end = time.perf_counter()
    if state.interrupted:
        print("\nbench serve: interrupted; partial results:", file=sys.stderr)

    metrics = compute_metrics(state.results, state.duration, percentiles, slos)
    metrics["interrupted"] = state.interrupted
    metrics["peak_concurrency"] = state.peak_concurrency
    print(format_report(metrics, cfg, state.peak_concurrency), flush=True)

    if args.result_json:
        config = {k: v for k, v in vars(args).items() if not callable(v)}
        config.update(model=cfg.model, url=cfg.url)
        config.pop("api_key", None)
        doc = {
            "config": config,
            "metrics": metrics,
            "requests": [request_row(r, slos) for r in state.results],
        }
        try:
            with open(args.result_json, "w") as f:
                json.dump(_json_safe(doc), f, indent=1, default=str)
                f.write("\n")
        except OSError as exc:
            print(f"bench serve: cannot write {args.result_json}: {exc}", file=sys.stderr)
            return 2
        print(f"bench serve: results written to {args.result_json}")

    if state.interrupted:
        return 130
    return 0 if metrics["completed"] > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Streaming load benchmark for an OpenAI-compatible server.",
    )
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
