"""The gateway's working parts behind the HTTP routes, owned by one app.

``GatewayService`` holds the tokenizer, the Redis client (one per app, with a
large blocking pool: every in-flight request holds a connection during its
blocking XREAD), the router, the metrics and the background tasks that must
outlive a cancelled request (aborts, stream cleanup). Routes call
``prepare_*`` (validate + tokenize, off the event loop) and ``start`` (admit,
maybe after a wait in the ``AdmissionQueue``, then submit), then stream or
collect the returned ``Generation``.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import replace

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from tandem.cluster.lora_registry import LoraRecord
from tandem.cluster.settings import Settings
from tandem.gateway.admission_queue import AdmissionQueue
from tandem.gateway.background import BackgroundTasks
from tandem.gateway.choices import Choices
from tandem.gateway.dispatch import Dispatcher
from tandem.gateway.drain import Drain
from tandem.gateway.errors import ClientDisconnected
from tandem.gateway.generation import Generation
from tandem.gateway.lora_adapters import LoraAdapters
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.mux import OutputMux
from tandem.gateway.chat_protocol import ChatCompletionRequest
from tandem.gateway.protocol import CompletionRequest
from tandem.gateway.resume import ResumableStreams
from tandem.gateway.router import ROLES, PromptPrefix, Router
from tandem.gateway.stream_log import RetainedRequest, StreamLog
from tandem.gateway.token_events import POLL_S
from tandem.gateway.text_stream import TextStream
from tandem.cluster.tokenizer import load_tokenizer
from tandem.gateway.tokenize_lanes import TokenizeLanes
from tandem.gateway.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from tandem.gateway.validation import GenerationInput, choice_input

log = structlog.get_logger(__name__)

MAX_REDIS_CONNECTIONS = 4096
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_POOL_WAIT_S = 30.0
STARTUP_WAIT_S = REDIS_CONNECT_TIMEOUT_S  # longest startup waits for the admission scripts to load


def make_redis(url: str) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_REDIS_CONNECTIONS,
        timeout=REDIS_POOL_WAIT_S,  # wait for a free connection rather than fail at once
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=POLL_S + 10.0,  # longer than any blocking XREAD we issue
        # one retry: a pooled connection may be stale after a Redis restart
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1),
    )
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool


class GatewayService:
    def __init__(self, settings: Settings, tokenizer=None, redis: aioredis.Redis | None = None):
        self.settings = settings
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer or settings.model)
        self.lanes = TokenizeLanes(settings, self.tokenizer)  # validation and tokenization, off the loop
        self.redis = redis if redis is not None else make_redis(settings.redis_url)
        self.router = Router(self.redis, model=settings.model_name, prefix_routing=settings.enable_prefix_caching)
        self.adapters = LoraAdapters(settings, self.redis)  # --enable-lora: the served adapters
        self._num_adapters: int | None = None  # at the last scrape (None: LoRA off, or not read yet)
        self.metrics = GatewayMetrics(lambda: {role: self.router.cached(role) for role in ROLES},
                                      lora_snapshot=lambda: self._num_adapters)
        self.admission = AdmissionQueue(self.router, max_queue_len=settings.max_queue_len,
                                        queue_timeout_s=settings.queue_timeout_s, queued_gauge=self.metrics.queued)
        self.mux = OutputMux(self.redis)
        self.background = BackgroundTasks()
        self.drain = Drain()
        self.dispatcher = Dispatcher(self.router, self.admission, self.mux.stream, self.background,
                                     heartbeat_ttl_s=settings.heartbeat_ttl_s,
                                     failover_wait_s=settings.failover_wait_s)
        # a token id's own text, for logprobs (decoded alone, special tokens included; on the loop,
        # as the detokenizer runs)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: self.tokenizer.decode([token_id], skip_special_tokens=False))

    # ---- requests -------------------------------------------------------------------
    async def prepare_completion(self, body: CompletionRequest) -> list[GenerationInput]:
        """The request's model resolved (the base model or a served LoRA adapter, else 404), then
        validated and tokenized: one input per prompt (a batch has several)."""
        return await self.lanes.completion(body, await self.adapters.resolve(body.model))

    async def prepare_chat(self, body: ChatCompletionRequest) -> list[GenerationInput]:
        return [await self.lanes.chat(body, await self.adapters.resolve(body.model))]

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize answer: the token ids (and their strings, when asked), their count and the
        model's maximum sequence length."""
        token_ids = await self.lanes.tokenize(body, await self.adapters.resolve(body.model))
        strs = self.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return {"count": len(token_ids), "max_model_len": self.settings.max_seq_len, "tokens": token_ids,
                "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        return {"prompt": await self.lanes.detokenize(body, await self.adapters.resolve(body.model))}

    async def start(self, inputs: list[GenerationInput], prefix: str = "cmpl",
                    client_left: asyncio.Event | None = None) -> Choices:
        """Admit each prompt's ``n`` choices (``best_of`` sequences when more, of which ``Choices``
        returns the best n), prompt by prompt, to a decode worker and submit them; raises
        NoWorkerAvailable, ServerBusy (429) or RedisError, or ClientDisconnected where
        ``client_left`` (set when the client goes away: watched while queued and once more before
        submitting) says the client left. Sequences already started when one cannot start are aborted. Every sequence ends
        under one finish reason in the metrics: a started one when its ``Generation`` closes,
        one never started here (``abort`` when its client left, ``error`` otherwise). Sequence k
        of prompt p is the request's sequence p * per_prompt + k (its wire id's suffix, unless the
        request is one sequence: the request id alone)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        structlog.contextvars.bind_contextvars(request_id=request_id)
        arrived_at = time.monotonic()
        first = inputs[0]  # the batch's prompts share their sampling and choices
        per_prompt = max(first.best_of, first.n)
        num_sequences = per_prompt * len(inputs)
        generations: list[Generation] = []
        try:
            for inp in inputs:
                if per_prompt > inp.n and inp.sampling.logprobs is None:
                    # best_of ranks the sequences by their tokens' logprobs: asked for, dropped from the response
                    inp = replace(inp, sampling=replace(inp.sampling, logprobs=0))
                for index in range(per_prompt):
                    wire_id = request_id if num_sequences == 1 else f"{request_id}-{len(generations)}"
                    generations.append(await self._start_one(choice_input(inp, index), wire_id, arrived_at,
                                                             client_left))
        except BaseException as exc:
            for generation in generations:
                generation.close()  # each counts its own finish
            # the sequences never started end here, under one reason each like any other
            gone = isinstance(exc, (ClientDisconnected, asyncio.CancelledError))
            self.metrics.finished.labels(finish_reason="abort" if gone else "error").inc(
                num_sequences - len(generations))
            raise
        return Choices(request_id, generations, n=first.n, logprobs_asked=first.sampling.logprobs is not None,
                       num_prompts=len(inputs))

    async def _start_one(self, inp: GenerationInput, request_id: str, arrived_at: float,
                         client_left: asyncio.Event | None) -> Generation:
        dispatcher = self.dispatcher
        worker = await dispatcher.admit(request_id, len(inp.prompt_token_ids), inp.max_tokens, inp.priority,
                                        client_left=client_left,
                                        prompt=PromptPrefix(inp.prompt_token_ids, inp.lora_digest))
        if client_left is not None and client_left.is_set():  # left while its room was being reserved
            dispatcher.release(worker.worker_id, request_id)
            raise ClientDisconnected("client disconnected before submission")
        generation = Generation(request_id, inp, worker, backend=dispatcher, mux=self.mux, metrics=self.metrics,
                                text=TextStream(self.tokenizer, inp), timeout_s=self.settings.request_timeout_s,
                                arrived_at=arrived_at)
        try:
            await dispatcher.submit(worker, request_id, inp, arrival_time=generation.arrival_time)
        except BaseException:
            self.mux.unregister(request_id)
            raise
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(len(inp.prompt_token_ids))
        log.debug("request submitted", worker_id=worker.worker_id, num_prompt_tokens=len(inp.prompt_token_ids),
                 max_tokens=inp.max_tokens, choice=request_id)
        return generation

    # ---- resumable streams ----------------------------------------------------------
    @functools.cached_property
    def streams(self) -> ResumableStreams:
        """Resumable streams: their events in Redis, the resume route, takeovers (built on first use)."""
        stream_log = StreamLog(self.redis, owner=self.mux.gateway_id, retention_s=self.settings.stream_retention_s)
        return ResumableStreams(stream_log, background=self.background, canceller=self.dispatcher,
                                continue_generation=self.continue_generation, token_text=self.token_text)

    async def continue_generation(self, request: RetainedRequest, batches: list[list[int]], wire_seq: int,
                                  cached_tokens: int) -> Generation:
        """Resubmit a resumable request whose gateway was lost, from the output tokens its client
        has (``batches``, as its events carried them), as a decode-worker failover does: wire id
        ``<id>.<wire_seq>``, admitted as resumed (charged prompt + those tokens, then the rest),
        its text caught up on them, its arrival time kept."""
        inp, request_id = request.inp, request.request_id
        text = TextStream(self.tokenizer, inp)
        text.catch_up(batches)
        done = len(text.output_token_ids)
        wire_id = f"{request_id}.{wire_seq}"
        arrived_at, timeout_s = time.monotonic(), self.settings.request_timeout_s
        worker = await self.dispatcher.admit(wire_id, len(inp.prompt_token_ids) + done, max(inp.max_tokens - done, 1),
                                             inp.priority, resumed=True, deadline=arrived_at + timeout_s)
        generation = Generation(request_id, inp, worker, backend=self.dispatcher, mux=self.mux, metrics=self.metrics,
                                text=text, timeout_s=timeout_s, arrived_at=arrived_at, wire_seq=wire_seq)
        generation.arrival_time = request.arrival_time
        generation.num_cached_tokens = cached_tokens
        try:
            await self.dispatcher.submit(worker, wire_id, inp, text.output_token_ids, arrival_time=request.arrival_time)
        except BaseException:
            self.mux.unregister(wire_id)
            raise
        self.metrics.running.inc()
        log.info("resumable request resubmitted", worker_id=worker.worker_id, wire_id=wire_id,
                 num_output_tokens=done)
        return generation

    async def prepare(self) -> None:
        """At startup: every ``--lora-modules`` adapter checked and served (a bad one raises:
        the gateway must not start), and Redis's side of admission ready before the first
        request (if Redis is down the gateway starts anyway; redis-py loads the scripts on
        first use then, and the adapters are registered by a retry in the background).

        Waits at most STARTUP_WAIT_S: a Redis that accepts connections but does not answer
        would hold the load for the read timeout and its retry (over 20 s). The load goes on
        in the background then; it is not cancelled (redis-py may swallow a cancellation)."""
        loading = self.background.spawn(self._load_scripts())
        await self.adapters.serve_startup_modules(self.background)
        await asyncio.wait({loading}, timeout=STARTUP_WAIT_S)
        if not loading.done():
            log.warning("admission scripts not loaded yet, starting anyway", wait_s=STARTUP_WAIT_S)

    async def _load_scripts(self) -> None:
        try:
            await self.router.load_scripts()
        except Exception as exc:  # any Redis failure: health reports it
            log.warning("could not load the admission scripts at startup", error=str(exc))

    # ---- cluster state --------------------------------------------------------------
    async def health(self) -> tuple[bool, dict]:
        """(healthy, report): not draining, Redis answers and at least one decode and one prefill
        worker is alive (or a decode worker that runs both pools)."""
        if self.drain.draining:
            return False, {"status": "draining", "reason": "the gateway is shutting down"}
        try:
            await self.redis.ping()
            workers = {role: await self.router.workers(role, max_age_s=0.0) for role in ROLES}
        except Exception as exc:  # any Redis failure means unhealthy, whatever its type
            return False, {"status": "unavailable", "reason": f"redis unreachable: {exc}"}
        counts = {role: len(found) for role, found in workers.items()}
        report = {"status": "ok", "decode_workers": counts["decode"], "prefill_workers": counts["prefill"]}
        if any(w.computes_prompts for w in workers["decode"]):
            counts["prefill"] = max(counts["prefill"], 1)  # a worker running both pools needs no other
        missing = [role for role in ROLES if counts[role] == 0]
        if missing:
            report.update(status="unavailable", reason=f"no live {' or '.join(missing)} worker")
        return not missing, report

    async def metrics_text(self) -> bytes:
        try:
            for role in ROLES:
                await self.router.workers(role)
            if self.adapters.enabled:
                self._num_adapters = len(await self.adapters.list())
        except Exception as exc:  # still serve the gateway's own metrics
            log.warning("cannot refresh worker registry for metrics", error=str(exc))
        return self.metrics.render()

    async def model_cards(self) -> list[dict]:
        """GET /v1/models: the base model, then every served LoRA adapter (vLLM's shape: its
        ``parent`` the base model, its ``root`` the adapter's directory). Redis unreachable: the
        base model alone (the route stays a probe that answers)."""
        cards = [self.model_card()]
        try:
            adapters = await self.adapters.list()
        except Exception as exc:  # any Redis failure
            log.warning("cannot read the served LoRA adapters for /v1/models", error=str(exc))
            adapters = []
        return cards + [self.model_card(adapter) for adapter in adapters]

    async def model_card_of(self, model: str) -> dict:
        """GET /v1/models/{model}: the base model's card or a served adapter's; else 404."""
        return self.model_card(await self.adapters.resolve(model))

    def model_card(self, adapter: LoraRecord | None = None) -> dict:
        """The base model's card, or a served adapter's."""
        if adapter is None:
            return {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "tandem",
                    "root": self.settings.model, "parent": None, "max_model_len": self.settings.max_seq_len}
        return {"id": adapter.name, "object": "model", "created": adapter.created, "owned_by": "tandem",
                "root": adapter.path, "parent": self.settings.model_name, "max_model_len": self.settings.max_seq_len}

    # ---- plumbing -------------------------------------------------------------------
    async def close(self) -> None:
        await self.mux.stop()
        await self.background.wait(5.0)
        await self.redis.aclose()
        self.lanes.shutdown()
        self.adapters.close()
