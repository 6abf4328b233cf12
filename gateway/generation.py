"""One request's life in the gateway, from submission to its last text delta.

Statuses (``Generation.status``)::

    SUBMITTED --first event--> STREAMING --last event--> FINISHED
        |                          |--stop string matched--> FINISHED (worker aborted)
        |                          |--worker error / timeout--> FAILED
        |--------------------------+--decode worker lost--> (resubmitted) same status
        +--------------------------+--client gone (cancelled)--> ABORTED

Failover: when the decode worker holding the request stops heartbeating, the
request is admitted again on a live decode worker under a new wire id
(``<request_id>.<n>``; late events of the old one are dropped with its queue)
carrying the tokens the client already has; that worker recomputes their KV
and goes on, so the client sees one uninterrupted stream (greedy and seeded
sampling give the same tokens as without the loss). At most
``MAX_FAILOVERS`` times per request.

``deltas()`` reads the request's events (routed to its queue by the
gateway's ``OutputMux``), orders tokens by index, detokenizes incrementally
and applies stop strings. ``close()`` runs on every exit path (it is
idempotent and synchronous, so it also works from a cancelled task or a
closing generator): a request the workers may still be running gets an
``AbortRequest`` (sent from a background task so a cancellation cannot stop
it), its queue is unregistered (late events are dropped), and the metrics are
recorded.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog
from redis.exceptions import RedisError

from tandem.cluster.messages import WorkerInfo
from tandem.gateway.detokenizer import IncrementalDetokenizer
from tandem.gateway.errors import NoWorkerAvailable, RequestTimeout, ServerBusy, WorkerFailed, WorkerLost
from tandem.gateway.responses import Delta, Usage
from tandem.gateway.stop import StopChecker
from tandem.gateway.streams import TokenAssembler, read_queued_events
from tandem.gateway.validation import GenerationInput

if TYPE_CHECKING:
    from tandem.gateway.service import GatewayService

log = structlog.get_logger(__name__)

MAX_FAILOVERS = 3


class Status(enum.Enum):
    SUBMITTED = "submitted"
    STREAMING = "streaming"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


_FINISH_LABELS = {Status.FAILED: "error", Status.ABORTED: "abort"}


class Generation:
    def __init__(self, service: "GatewayService", request_id: str, inp: GenerationInput, worker: WorkerInfo,
                 arrived_at: float | None = None):
        """``arrived_at`` (monotonic): when the request reached the gateway; TTFT, E2E and the deadline count from it."""
        self.service = service
        self.request_id = request_id  # what the client sees
        self._wire_id = request_id  # what the workers see (changes on a failover)
        self._failovers = 0
        self.input = inp
        self.worker_id = worker.worker_id
        self._worker_started_at = worker.started_at
        self.created = int(time.time())
        self.arrival_time = time.time()  # wall clock, as the workers order their queues by it
        self.status = Status.SUBMITTED
        self.output_token_ids: list[int] = []
        self.output_logprobs: list = []  # one entry per output token, when the request asked for logprobs
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self._started_at = time.monotonic() if arrived_at is None else arrived_at
        self._deadline = self._started_at + service.settings.request_timeout_s
        self._first_token_at: float | None = None
        self._worker_done = False  # the worker sent its last event: nothing to abort
        self._abort_reason = "client disconnected"
        self._failed = False
        self._closed = False
        self._detokenizer = IncrementalDetokenizer(service.tokenizer, inp.prompt_token_ids, inp.skip_special_tokens)
        self._stop = StopChecker(inp.stop, inp.include_stop_str_in_output)
        self._queue = service.mux.register(request_id)  # before submission: no event can be missed

    @property
    def wire_id(self) -> str:
        return self._wire_id

    @property
    def usage(self) -> Usage:
        return Usage(len(self.input.prompt_token_ids), len(self.output_token_ids), self.num_cached_tokens)

    @property
    def text(self) -> str:
        return self._stop.text

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas until the request ends; the last one carries ``finish_reason``."""
        assembler = TokenAssembler()
        try:
            while True:
                try:
                    async for delta in self._deltas_from_worker(assembler):
                        yield delta
                    return
                except WorkerLost:
                    self._let_go()  # the lost worker: its room back and, if it was only slow, an abort
                    if self._failovers >= MAX_FAILOVERS:
                        raise
                    await self._fail_over(assembler)
        except Exception as exc:
            self._failed = True
            self._abort_reason = "timeout" if isinstance(exc, RequestTimeout) else "gateway error"
            raise
        finally:
            self.close()

    async def _deltas_from_worker(self, assembler: TokenAssembler) -> AsyncIterator[Delta]:
        """Deltas from the current worker's events until the request ends; raises WorkerLost."""
        events = read_queued_events(self._queue, deadline=self._deadline, worker_alive=self._worker_alive)
        try:
            async for event in events:
                if self._first_token_at is None:
                    self._on_first_event()
                if event.num_cached_tokens and not self.num_cached_tokens:
                    # only the prefill worker's event for index 0 carries it, and it may come second
                    self.num_cached_tokens = event.num_cached_tokens
                    self.service.metrics.cached_tokens.inc(event.num_cached_tokens)
                new_token_ids = assembler.add(event)
                if assembler.finish_reason == "error":
                    self._worker_done = True
                    raise WorkerFailed(f"the request failed on a worker: {assembler.error or 'unknown error'}")
                delta = self._advance(new_token_ids, assembler.finish_reason, assembler.new_logprobs)
                if delta is not None:
                    yield delta
                if self.finish_reason is not None:
                    return
        finally:
            await events.aclose()

    async def collect(self) -> tuple[str, list[int]]:
        """Run to the end; the whole text and output token ids."""
        async for _delta in self.deltas():
            pass
        return self.text, self.output_token_ids

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        service = self.service
        service.mux.unregister(self._wire_id)
        if self._failed:
            self.status = Status.FAILED
        elif self.finish_reason is not None:
            self.status = Status.FINISHED
        else:
            self.status = Status.ABORTED
        if not self._worker_done:
            service.spawn(service.abort(self.worker_id, self._wire_id, self._abort_reason))
        metrics = service.metrics
        metrics.running.dec()
        metrics.generation_tokens.inc(len(self.output_token_ids))
        metrics.finished.labels(finish_reason=_FINISH_LABELS.get(self.status, self.finish_reason)).inc()
        if self.status is Status.FINISHED:
            metrics.e2e.observe(time.monotonic() - self._started_at)
        log.info("request done", status=self.status.value, finish_reason=self.finish_reason,
                 num_output_tokens=len(self.output_token_ids), worker_id=self.worker_id)

    # ---- helpers --------------------------------------------------------------------
    def _on_first_event(self) -> None:
        self.status = Status.STREAMING
        self._first_token_at = time.monotonic()
        self.service.metrics.ttft.observe(self._first_token_at - self._started_at)

    def _advance(self, new_token_ids: list[int], worker_finish: str | None,
                 new_logprobs: list | None = None) -> Delta | None:
        """New tokens -> the text that may be sent now; sets ``finish_reason`` at the end."""
        if not new_token_ids and worker_finish is None:
            return None
        self.output_token_ids.extend(new_token_ids)
        logprobs = None
        if self.input.sampling.logprobs is not None:
            logprobs = list(new_logprobs or [None] * len(new_token_ids))
            self.output_logprobs.extend(logprobs)
        # "stop" from a worker means the last token is EOS or a stop token: its text is not output
        text_token_ids = new_token_ids[:-1] if worker_finish == "stop" else new_token_ids
        text = self._feed_text(text_token_ids, len(self.output_token_ids) - len(new_token_ids))
        if self._stop.stopped:
            self.finish_reason = "stop"
            self._abort_reason = "stop string"
            self._worker_done = worker_finish is not None
        elif worker_finish is not None:
            self.finish_reason = worker_finish
            self._worker_done = True
            text += self._stop.feed(self._detokenizer.flush())
            text += "" if self._stop.stopped else self._stop.flush()
            if self._stop.stopped:  # the released tail held a stop string
                self.finish_reason = "stop"
        return Delta(text, new_token_ids, self.finish_reason, logprobs)

    def _feed_text(self, token_ids: list[int], num_before: int) -> str:
        """Detokenize ``token_ids`` (output tokens num_before on) through the stop strings. With
        min_tokens, token by token: as vLLM, no stop string may end in the text of the first
        min_tokens tokens, whatever the batches the tokens arrive in."""
        min_tokens = self.input.sampling.min_tokens
        if num_before + len(token_ids) <= min_tokens or num_before >= min_tokens:
            return self._stop.feed(self._detokenizer.add(token_ids), match=num_before >= min_tokens)
        text = ""
        for offset, token_id in enumerate(token_ids):
            text += self._stop.feed(self._detokenizer.add([token_id]), match=num_before + offset >= min_tokens)
            if self._stop.stopped:
                break
        return text

    def _let_go(self) -> None:
        """Stop counting on the current worker: release its reservation, send it an abort
        (a dead worker never reads it; a slow one stops), drop its late events."""
        service = self.service
        self._worker_done = True
        service.mux.unregister(self._wire_id)
        service.spawn(service.router.release(self.worker_id, self._wire_id))
        service.spawn(service.abort(self.worker_id, self._wire_id, "worker lost"))

    async def _fail_over(self, assembler: TokenAssembler) -> None:
        """The decode worker holding the request is gone: resubmit it, with the tokens the
        client already has, to a live one. It keeps its arrival time; the admission wait is
        bounded by the request's deadline; no room or no worker reads as the loss it is."""
        service, lost_worker = self.service, self.worker_id
        self._failovers += 1
        self._wire_id = f"{self.request_id}.{self._failovers}"
        self._queue = service.mux.register(self._wire_id)
        assembler.forget_pending()  # only tokens already released count; the rest is regenerated
        inp, done = self.input, len(self.output_token_ids)
        try:
            # charged as the worker will hold it: prompt + the tokens it recomputes, then the rest
            worker = await service.admission.admit(
                self._wire_id, len(inp.prompt_token_ids) + done, max(inp.max_tokens - done, 1), inp.priority,
                resumed=True, deadline=self._deadline)
        except (NoWorkerAvailable, ServerBusy) as exc:
            raise WorkerLost(f"the decode worker serving this request stopped responding and no other "
                             f"could take it: {exc}") from None
        # from here a client disconnect must abort the new worker (close() does it)
        self.worker_id, self._worker_started_at, self._worker_done = worker.worker_id, worker.started_at, False
        await service.submit(worker, self._wire_id, inp, self.output_token_ids, arrival_time=self.arrival_time)
        service.metrics.failovers.inc()
        log.warning("decode worker lost: request resumed on another", lost_worker_id=lost_worker,
                    worker_id=worker.worker_id, num_output_tokens=len(self.output_token_ids),
                    failover=self._failovers)

    async def _worker_alive(self) -> bool:
        """Whether the decode worker still heartbeats. A Redis error says nothing about it (the
        worker keeps its events in its outbox through an outage): keep waiting, the request's
        deadline bounds the wait."""
        try:
            return await self.service.router.is_alive("decode", self.worker_id, self._worker_started_at)
        except RedisError:
            return True
