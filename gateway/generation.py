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

A Generation can also start from output tokens a client already has (a
resumable stream whose gateway was lost, continued by another: its
``TextStream`` has caught up on them and ``wire_seq`` numbers its first wire
id): it then expects the worker's events from the index after them on.

``deltas()`` reads the request's events (routed to its queue by the
gateway's ``OutputMux``), orders tokens by index and hands them to its
``TextStream`` (detokenizer, stop strings, logprobs: no I/O). The cluster is
reached only through a ``Backend`` (admit, submit, abort, release,
is_alive; the gateway's ``Dispatcher``). ``close()`` runs on every exit path (it is
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
from typing import Protocol

import structlog

from tandem.cluster.messages import WorkerInfo
from tandem.gateway.errors import NoWorkerAvailable, RequestTimeout, ServerBusy, WorkerFailed, WorkerLost
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.mux import OutputMux
from tandem.gateway.responses import Delta, PromptPart, Usage
from tandem.gateway.token_events import TokenAssembler, read_queued_events
from tandem.gateway.text_stream import TextStream
from tandem.gateway.validation import GenerationInput

log = structlog.get_logger(__name__)

MAX_FAILOVERS = 3
GAP_TIMEOUT_S = 2.0  # later tokens waiting this long for an earlier one: it was lost


class Backend(Protocol):
    """What a request needs of the cluster (``tandem.gateway.dispatch.Dispatcher``)."""

    async def admit(self, wire_id: str, num_prompt_tokens: int, max_tokens: int, priority: int = 0, *,
                    resumed: bool = False, deadline: float | None = None) -> WorkerInfo: ...

    async def submit(self, worker: WorkerInfo, wire_id: str, inp: GenerationInput,
                     output_token_ids: list[int] | None = None, arrival_time: float | None = None) -> None: ...

    def abort(self, worker_id: str, wire_id: str, reason: str) -> None: ...

    def release(self, worker_id: str, wire_id: str) -> None: ...

    async def is_alive(self, worker_id: str, started_at: float | None) -> bool: ...


class Status(enum.Enum):
    SUBMITTED = "submitted"
    STREAMING = "streaming"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


_FINISH_LABELS = {Status.FAILED: "error", Status.ABORTED: "abort"}


class Generation:
    def __init__(self, request_id: str, inp: GenerationInput, worker: WorkerInfo, *, backend: Backend,
                 mux: OutputMux, metrics: GatewayMetrics, text: TextStream, timeout_s: float,
                 arrived_at: float | None = None, wire_seq: int = 0):
        """``arrived_at`` (monotonic): when the request reached the gateway; TTFT and E2E count
        from it. The deadline is ``timeout_s`` after now, the request's admission (the wait for
        room is the admission queue's to bound). ``wire_seq`` > 0: the first wire id is
        ``<request_id>.<wire_seq>`` (a request continued from another gateway's, whose wire ids
        are not to be reused)."""
        self._backend = backend
        self._mux = mux
        self._metrics = metrics
        self._text = text
        self.request_id = request_id  # what the client sees
        self._wire_seq = wire_seq
        self._wire_id = f"{request_id}.{wire_seq}" if wire_seq else request_id  # what the workers see (changes on a failover)
        self._failovers = 0
        self.input = inp
        self.worker_id = worker.worker_id
        self._worker_started_at = worker.started_at
        self.created = int(time.time())
        self.arrival_time = time.time()  # wall clock, as the workers order their queues by it
        self.status = Status.SUBMITTED
        self.num_cached_tokens = 0
        self._started_at = time.monotonic() if arrived_at is None else arrived_at
        self._deadline = time.monotonic() + timeout_s
        self._first_token_at: float | None = None
        self._worker_done = False  # the worker sent its last event: nothing to abort
        self._abort_reason = "client disconnected"
        self._failed = False
        self._closed = False
        self._queue = mux.register(self._wire_id)  # before submission: no event can be missed

    @property
    def wire_id(self) -> str:
        return self._wire_id

    @property
    def wire_seq(self) -> int:
        """The current wire id's suffix (0: the request id itself)."""
        return self._wire_seq

    @property
    def output_token_ids(self) -> list[int]:
        return self._text.output_token_ids

    @property
    def output_logprobs(self) -> list:
        return self._text.output_logprobs

    @property
    def finish_reason(self) -> str | None:
        return self._text.finish_reason

    @property
    def prompt(self) -> PromptPart | None:
        """What leads the choice of its prompt: echo's text, the prompt's logprobs (when asked)."""
        return self._text.prompt

    @property
    def usage(self) -> Usage:
        return Usage(len(self.input.prompt_token_ids), len(self.output_token_ids), self.num_cached_tokens)

    @property
    def text(self) -> str:
        return self._text.text

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas until the request ends; the last one carries ``finish_reason``."""
        # tokens the text already holds (a request continued from another gateway) are not sent again
        assembler = TokenAssembler(num_tokens=len(self.output_token_ids))
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
        async def worker_alive() -> bool:  # a gap that lasts is a loss too, even from a live worker
            return assembler.gap_s() <= GAP_TIMEOUT_S and await self._worker_alive()

        events = read_queued_events(self._queue, deadline=self._deadline, worker_alive=worker_alive)
        try:
            async for batch in events:  # every event that arrived since the last batch: one delta
                if self._first_token_at is None:
                    self._on_first_event()
                new_token_ids: list[int] = []
                new_logprobs: list = []
                for event in batch:
                    if event.num_cached_tokens and not self.num_cached_tokens:
                        # only the prefill worker's event for index 0 carries it, and it may come second
                        self.num_cached_tokens = event.num_cached_tokens
                        self._metrics.cached_tokens.inc(event.num_cached_tokens)
                    if event.prompt_logprobs is not None and self._text.prompt_logprobs is None:
                        self._text.prompt_logprobs = event.prompt_logprobs  # index 0's: before any delta is made
                    new_token_ids.extend(assembler.add(event))
                    new_logprobs.extend(assembler.new_logprobs)
                if assembler.gap_s() > GAP_TIMEOUT_S:
                    raise WorkerLost(f"tokens of this request were lost in transit (a gap of {assembler.gap_s():.1f} s)")
                if assembler.finish_reason == "error":
                    self._worker_done = True
                    if new_token_ids:  # the tokens released before the failure still go out
                        delta = self._advance(new_token_ids, None, new_logprobs)
                        if delta is not None:
                            yield delta
                    raise WorkerFailed(f"the request failed on a worker: {assembler.error or 'unknown error'}")
                delta = self._advance(new_token_ids, assembler.finish_reason, new_logprobs)
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
        self._mux.unregister(self._wire_id)
        if self._failed:
            self.status = Status.FAILED
        elif self.finish_reason is not None:
            self.status = Status.FINISHED
        else:
            self.status = Status.ABORTED
        if not self._worker_done:
            self._backend.abort(self.worker_id, self._wire_id, self._abort_reason)
        metrics = self._metrics
        metrics.running.dec()
        metrics.generation_tokens.inc(len(self.output_token_ids))
        metrics.finished.labels(finish_reason=_FINISH_LABELS.get(self.status, self.finish_reason)).inc()
        if self.status is Status.FINISHED:
            metrics.e2e.observe(time.monotonic() - self._started_at)
        log.debug("request done", status=self.status.value, finish_reason=self.finish_reason,
                 num_output_tokens=len(self.output_token_ids), worker_id=self.worker_id)

    # ---- helpers --------------------------------------------------------------------
    def _on_first_event(self) -> None:
        self.status = Status.STREAMING
        self._first_token_at = time.monotonic()
        self._metrics.ttft.observe(self._first_token_at - self._started_at)

    def _advance(self, new_token_ids: list[int], worker_finish: str | None,
                 new_logprobs: list | None = None) -> Delta | None:
        delta = self._text.advance(new_token_ids, worker_finish, new_logprobs)
        if delta is None:
            return None
        if self._text.stopped_by_string and worker_finish is None:
            self._abort_reason = "stop string"  # the worker generates on: close() aborts it
        elif self.finish_reason is not None:
            self._worker_done = True
        return delta

    def _let_go(self) -> None:
        """Stop counting on the current worker: release its reservation, send it an abort
        (a dead worker never reads it; a slow one stops), drop its late events."""
        self._worker_done = True
        self._mux.unregister(self._wire_id)
        self._backend.release(self.worker_id, self._wire_id)
        self._backend.abort(self.worker_id, self._wire_id, "worker lost")

    async def _fail_over(self, assembler: TokenAssembler) -> None:
        """The decode worker holding the request is gone: resubmit it, with the tokens the
        client already has, to a live one. It keeps its arrival time; the admission wait is
        bounded by the request's deadline; no room or no worker reads as the loss it is."""
        lost_worker = self.worker_id
        self._failovers += 1
        self._wire_seq += 1
        self._wire_id = f"{self.request_id}.{self._wire_seq}"
        self._queue = self._mux.register(self._wire_id)
        assembler.forget_pending()  # only tokens already released count; the rest is regenerated
        inp, done = self.input, len(self.output_token_ids)
        try:
            # charged as the worker will hold it: prompt + the tokens it recomputes, then the rest
            worker = await self._backend.admit(
                self._wire_id, len(inp.prompt_token_ids) + done, max(inp.max_tokens - done, 1), inp.priority,
                resumed=True, deadline=self._deadline)
        except (NoWorkerAvailable, ServerBusy) as exc:
            raise WorkerLost(f"the decode worker serving this request stopped responding and no other "
                             f"could take it: {exc}") from None
        # from here a client disconnect must abort the new worker (close() does it)
        self.worker_id, self._worker_started_at, self._worker_done = worker.worker_id, worker.started_at, False
        await self._backend.submit(worker, self._wire_id, inp, self.output_token_ids, arrival_time=self.arrival_time)
        self._metrics.failovers.inc()
        log.warning("decode worker lost: request resumed on another", lost_worker_id=lost_worker,
                    worker_id=worker.worker_id, num_output_tokens=len(self.output_token_ids),
                    failover=self._failovers)

    async def _worker_alive(self) -> bool:
        return await self._backend.is_alive(self.worker_id, self._worker_started_at)
