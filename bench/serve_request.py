"""One streaming request of ``tandem bench serve``: the client config, the request
body, sending it and timing its chunks into a :class:`RequestResult`, and the
``GET /v1/models`` lookup. Every failure of a request lands in its ``error``.
"""

from __future__ import annotations

import asyncio
import codecs
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.bench.datasets import RequestSpec
from tandem.bench.serve_metrics import RequestResult
from tandem.bench.sse import DONE, SSEDecoder, chunk_content, decode_payload, error_message, http_error_text

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


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
    lora_modules: tuple[str, ...] = ()  # adapter names: request i asks for lora_modules[i % n]

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
    model = cfg.lora_modules[spec.index % len(cfg.lora_modules)] if cfg.lora_modules else cfg.model
    payload: dict[str, Any] = {"model": model}
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
    """Send one streaming request and fill ``res``.

    While the stream runs, each network read is only stored with its arrival time;
    the events are decoded after the stream ends, each timed by the read that
    completed it. A client that parsed JSON per chunk fell behind a server streaming
    ~10k chunks/s and measured its own lag."""
    payload = build_payload(cfg, spec)
    t0 = time.perf_counter()
    reads: list[tuple[float, bytes]] = []
    async with client.stream("POST", cfg.url, json=payload, headers=cfg.headers()) as resp:
        if resp.status_code != 200:
            res.error = http_error_text(resp.status_code, await resp.aread())
            res.latency = time.perf_counter() - t0
            return
        async for raw in resp.aiter_bytes():
            reads.append((time.perf_counter(), raw))
    res.latency = res.received = time.perf_counter() - t0
    _replay(cfg, reads, t0, res)
    if res.last_token_at is not None:  # as vLLM: E2E ends at the last token, not the usage chunk or [DONE]
        res.latency = res.last_token_at
    if res.usage_output_tokens is not None:
        res.output_tokens = res.usage_output_tokens
    elif res.finish_reason == "length":  # no usage: max_tokens were generated (ignore_eos is sent)
        res.output_tokens = spec.output_len
    else:  # no usage and an early stop: a chunk may carry several tokens
        res.output_tokens, res.output_tokens_estimated = res.content_chunks, True
    if res.ttft is None:  # neither text nor a finish reason (a stream whose text is empty ends with one)
        res.error = "stream ended without any generated content"
        return
    res.success = True


def _replay(cfg: BenchConfig, reads: list[tuple[float, bytes]], t0: float, res: RequestResult) -> None:
    """Decode the stream's events from its reads into ``res`` (chunk times from the reads)."""
    text: list[str] = []
    decoder = SSEDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    last = t0
    pending = ""

    def handle(data: str, now: float) -> bool:
        """Returns True at the end of the stream."""
        nonlocal last
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
                res.last_token_at = now - t0
                res.content_chunks += 1
                if cfg.keep_text:
                    text.append(content)
            for choice in obj.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                if choice.get("finish_reason"):
                    res.finish_reason = str(choice["finish_reason"])
                    if res.ttft is None:  # every token's text was empty: the answer is complete all the same
                        res.ttft = res.last_token_at = now - t0
                if isinstance(choice.get("token_ids"), list):
                    res.token_ids += [int(t) for t in choice["token_ids"]]
            usage = obj.get("usage")
            if isinstance(usage, dict):
                if usage.get("completion_tokens") is not None:
                    res.usage_output_tokens = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    res.usage_prompt_tokens = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and details.get("cached_tokens") is not None:
                    res.usage_cached_tokens = int(details["cached_tokens"])
        return False

    try:
        for now, raw in reads:
            pending += utf8.decode(raw)
            *lines, pending = pending.split("\n")
            for line in lines:
                for data in decoder.feed(line):
                    if handle(data, now):
                        return
        now = reads[-1][0] if reads else t0
        for line in (pending + utf8.decode(b"", final=True)).split("\n"):
            for data in decoder.feed(line):
                if handle(data, now):
                    return
        for data in decoder.flush():
            handle(data, now)
    finally:
        res.generated_text = "".join(text)


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
    except Exception as exc:  # anything else a server's stream can provoke fails this request, not the run
        res.success = False
        res.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if res.latency is None or not res.success:
        res.latency = time.perf_counter() - t0
    if res.received is None:
        res.received = time.perf_counter() - t0
    res.finished = True
    return res


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
