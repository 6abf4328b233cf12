"""Resumable streams: a request that outlives its connection, resumed on any gateway.

POST with ``stream_options.resumable``: ``start`` retains the request
(``tandem.gateway.stream_log``) and produces its events in a background task
that holds the stream's lease (``_produce``: each event is appended to the log
before any client can see it), then answers with ``follow``: the log's events
read back from Redis up to ``[DONE]``. A client that goes away ends only its
follower; the request runs on and its events stay for ``--stream-retention-s``.

``GET /v1/streams/<id>`` on any gateway: ``open`` checks the stream and the
Last-Event-ID, then ``follow``s from the event after it. A follower with
nothing new checks the lease; when it is gone the producing gateway is gone
too (killed, cut off), and the follower's gateway takes the stream over (SET
NX: one gateway wins): it aborts the old wire id on the decode worker that was
writing to the lost gateway, resubmits the request with the retained output
tokens as a decode-worker failover does (``GatewayService.continue_generation``:
a new wire id, resumed admission, the TextStream caught up on those tokens)
and produces the remaining events, their seq going on after the last retained
one. So a client sees one stream, whichever gateways it read it from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import structlog
from redis.exceptions import RedisError

from tandem.gateway.background import BackgroundTasks
from tandem.gateway.choices import Choices
from tandem.gateway.errors import GatewayError, InvalidRequest
from tandem.gateway.generation import MAX_FAILOVERS, Generation
from tandem.gateway.responses import (
    DONE, ResponseFormat, StreamPosition, Usage, parse_event_id, sse_events, with_id,
)
from tandem.gateway.stream_log import LEASE_RENEW_S, LEASE_S, LoggedEvent, RetainedRequest, StreamLog, StreamRecord

log = structlog.get_logger(__name__)

FOLLOW_POLL_S = 1.0  # how often a waiting follower checks that someone still produces the stream
FOLLOW_RETRIES = 20  # Redis errors in a row before a follower ends its response (the client resumes)
RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class StreamNotFound(GatewayError):
    status_code = 404
    type = "invalid_request_error"
    code = "stream_not_found"


class Canceller(Protocol):
    """What a takeover needs of the cluster (``tandem.gateway.dispatch.Dispatcher``)."""

    def abort(self, worker_id: str, wire_id: str, reason: str) -> None: ...

    def release(self, worker_id: str, wire_id: str) -> None: ...


# a retained request, the token batches its events carried, its next wire seq and cached prompt
# tokens -> the request resubmitted (GatewayService.continue_generation)
ContinueGeneration = Callable[[RetainedRequest, list[list[int]], int, int], Awaitable[Generation]]


class ResumableStreams:
    def __init__(self, stream_log: StreamLog, *, background: BackgroundTasks, canceller: Canceller,
                 continue_generation: ContinueGeneration, token_text: Callable[[int], str],
                 poll_s: float = FOLLOW_POLL_S):
        self._log = stream_log
        self._background = background
        self._canceller = canceller
        self._continue_generation = continue_generation
        self._token_text = token_text
        self._poll_ms = int(poll_s * 1000)

    # ---- the first gateway -------------------------------------------------------------
    async def start(self, choices: Choices, fmt: ResponseFormat, include_usage: bool,
                    continuous_usage: bool) -> AsyncIterator[bytes]:
        """Retain a new stream (one choice) and produce it in the background; returns the events
        to send this client (followed from the log)."""
        generation = choices.generations[0]
        request = RetainedRequest(choices.request_id, fmt.chat, fmt.created, fmt.model, generation.input,
                                  include_usage, continuous_usage, fmt.return_token_ids, generation.arrival_time)
        try:
            await self._log.create(request, generation.worker_id, generation.wire_id)
        except BaseException:
            choices.close()
            raise
        position = StreamPosition()
        frames = sse_events(fmt, choices.deltas(), lambda: choices.usage, include_usage, continuous_usage,
                            position=position)
        self._background.spawn(self._produce(request.request_id, frames, position, generation, seq=0))
        return self.follow(request.request_id, after_seq=-1)

    # ---- any gateway -------------------------------------------------------------------
    async def open(self, request_id: str, last_event_id: str | None) -> AsyncIterator[bytes] | None:
        """The stream's events after ``last_event_id`` (from its first without one), live to its
        end; None when ``last_event_id`` is its last event (nothing remains: 204)."""
        after = -1
        if last_event_id:
            parsed = parse_event_id(request_id, last_event_id)
            if parsed is None:
                raise InvalidRequest(f"Last-Event-ID {last_event_id!r} is not an event id of stream "
                                     f"{request_id!r} (<request_id>.<seq>)", param="last_event_id")
            after = parsed
        described = await self._log.describe(request_id)
        if described is None:
            raise StreamNotFound(f"no resumable stream {request_id!r} (unknown, or its retention ended)",
                                 param="request_id")
        next_seq, done = described
        if after >= next_seq:
            raise InvalidRequest(f"stream {request_id!r} has not sent event {last_event_id!r}",
                                 param="last_event_id")
        if done and after == next_seq - 1:
            return None
        return self.follow(request_id, after)

    async def follow(self, request_id: str, after_seq: int) -> AsyncIterator[bytes]:
        """The retained events after ``after_seq``, then each one as it is appended, to [DONE]; a
        stream whose producer is gone is taken over on the way."""
        failures = 0
        while True:
            try:
                events = await self._log.read(request_id, after_seq, block_ms=self._poll_ms)
                if not events and not await self._someone_produces(request_id):
                    return  # its retention ended: a client resuming now gets 404
                failures = 0
            except RedisError as exc:
                if failures >= FOLLOW_RETRIES:
                    log.warning("resumable stream: Redis unreachable, ending the response", error=str(exc))
                    return  # the client resumes from its last event id
                await asyncio.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
                failures += 1
                continue
            for event in events:
                yield event.frame
                after_seq = event.seq
                if event.done:
                    return

    # ---- taking a stream over ----------------------------------------------------------
    async def _someone_produces(self, request_id: str) -> bool:
        """Nothing new arrived: whether the stream is still retained, taking it over when no
        gateway holds its lease."""
        if await self._log.lease_holder(request_id) is not None:
            return True
        if not await self._log.acquire(request_id, MAX_FAILOVERS + 1):
            # another gateway took it meanwhile, or it is no longer retained
            return await self._log.exists(request_id)
        try:
            record = await self._log.load(request_id)
        except BaseException:
            self._background.spawn(self._log.release(request_id))
            raise
        if record is None or record.done:  # it ended just before its lease was let go
            await self._log.release(request_id)
            return record is not None
        self._background.spawn(self._continue(record))
        return True

    async def _continue(self, record: StreamRecord) -> None:
        """Produce the rest of a stream whose gateway was lost (this gateway holds its lease)."""
        request = record.request
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        # the decode worker still writing to the lost gateway: stop it, its room back (as a failover's let-go)
        self._canceller.release(record.worker_id, record.wire_id)
        self._canceller.abort(record.worker_id, record.wire_id, "gateway lost")
        last = record.events[-1].state if record.events else None
        position = StreamPosition.from_dict(last["position"]) if last else StreamPosition()
        continuation = _Continuation(record, last["cached"] if last else 0)
        fmt = ResponseFormat(request.request_id, request.created, request.model, request.chat,
                             request.return_token_ids, [request.inp.prompt_token_ids], self._token_text)
        # its one choice sent its last chunk: only the usage chunk and [DONE] can remain
        deltas = _nothing() if 0 in position.finished else self._continued_deltas(continuation)
        frames = sse_events(fmt, deltas, lambda: continuation.usage, request.include_usage,
                            request.continuous_usage, position=position)
        log.warning("resumable stream taken over: its gateway was lost", lost_worker_id=record.worker_id,
                    lost_wire_id=record.wire_id, num_events=record.next_seq,
                    num_output_tokens=len(continuation.output_token_ids))
        await self._produce(request.request_id, frames, position, continuation, seq=record.next_seq)

    async def _continued_deltas(self, continuation: "_Continuation"):
        # resubmitted here, inside the stream, so that a failure becomes its error event
        record = continuation.record
        generation = await self._continue_generation(
            record.request, [e.token_ids for e in record.events], record.wire_seq, continuation.cached_tokens)
        continuation.generation = generation
        try:  # recorded now, not with the next event: a takeover of this takeover must abort this wire id
            await self._log.set_worker(record.request.request_id, generation.worker_id, generation.wire_id)
        except RedisError as exc:  # the next event's append records it
            log.warning("resumable stream: could not record its new decode worker", error=str(exc))
        async for delta in continuation.generation.deltas():
            yield 0, delta

    # ---- producing ---------------------------------------------------------------------
    async def _produce(self, request_id: str, frames: AsyncIterator[bytes], position: StreamPosition,
                       source: "_Source", seq: int) -> None:
        """Append each event of ``frames`` under this gateway's lease, until [DONE] or the lease is
        lost; ``source`` says which output tokens each event carries and where the request runs."""
        keeper = asyncio.ensure_future(self._keep_lease(request_id, asyncio.current_task()))
        num_logged = len(source.output_token_ids)
        try:
            async for frame in frames:
                tokens = source.output_token_ids[num_logged:]
                event = LoggedEvent(seq, with_id(frame, request_id, seq), tokens,
                                    {"position": position.to_dict(), "cached": source.num_cached_tokens},
                                    frame == DONE)
                if not await self._append(request_id, event, source):
                    log.warning("resumable stream: lease lost, no longer producing it", seq=seq)
                    return
                num_logged += len(tokens)
                seq += 1
        finally:
            keeper.cancel()
            await frames.aclose()
            source.close()  # a request still running (the lease was lost) is aborted
            self._background.spawn(self._log.release(request_id))

    async def _append(self, request_id: str, event: LoggedEvent, source: "_Source") -> bool:
        """Append, retried through Redis errors for as long as the lease could still be ours."""
        deadline, failures = time.monotonic() + LEASE_S, 0
        while True:
            try:
                return await self._log.append(request_id, event, source.worker_id, source.wire_id)
            except RedisError:
                delay = RETRY_S[min(failures, len(RETRY_S) - 1)]
                if time.monotonic() + delay > deadline:
                    return False  # the lease has lapsed by now: a follower takes the stream over
                failures += 1
                await asyncio.sleep(delay)

    async def _keep_lease(self, request_id: str, producer: asyncio.Task) -> None:
        while True:
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                if not await self._log.renew(request_id):
                    log.warning("resumable stream: lease taken by another gateway, stopping")
                    producer.cancel()
                    return
            except RedisError:
                pass  # the appends decide: they stop once the lease could have lapsed


class _Source(Protocol):
    """Where a produced stream's tokens come from (a Generation, or a ``_Continuation``)."""

    output_token_ids: list[int]
    num_cached_tokens: int
    worker_id: str
    wire_id: str

    def close(self) -> None: ...


class _Continuation:
    """A taken-over request: its retained tokens and worker until it is resubmitted, its
    Generation's after."""

    def __init__(self, record: StreamRecord, cached_tokens: int):
        self.record = record
        self.cached_tokens = cached_tokens
        self._retained = [t for event in record.events for t in event.token_ids]
        self.generation: Generation | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.generation.output_token_ids if self.generation else self._retained

    @property
    def num_cached_tokens(self) -> int:
        return self.generation.num_cached_tokens if self.generation else self.cached_tokens

    @property
    def worker_id(self) -> str:
        return self.generation.worker_id if self.generation else self.record.worker_id

    @property
    def wire_id(self) -> str:
        return self.generation.wire_id if self.generation else self.record.wire_id

    @property
    def usage(self) -> Usage:
        if self.generation:
            return self.generation.usage
        return Usage(len(self.record.request.inp.prompt_token_ids), len(self._retained), self.cached_tokens)

    def close(self) -> None:
        if self.generation:
            self.generation.close()


async def _nothing():
    return
    yield
