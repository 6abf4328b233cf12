"""Decode-side capacity scheduler (plain Python, no torch).

Moves requests: QUEUED -(reserve blocks)-> PREFILLING -(KV complete)->
DECODING -> FINISHED; ABORTED or FAILED from any status. Blocks are freed on
every exit path; a PREFILLING request's blocks are freed only once the prefill
worker no longer writes them (``on_prefill_done`` or the receiver's failure).

GUARANTEED_NO_EVICT: a request is given blocks for its prompt plus
``max_tokens`` (capped at ``max_seq_len``) before its prefill starts, so a
started request never runs out of blocks and is never paused; requests that do
not fit wait in arrival order (priority first).

Sliding window (``attention_window``): after each step the blocks a request
no longer attends to are released and recycled for its later positions, so a
request reserves and holds only about a window's worth of blocks beyond its
prompt (``decode.window``).
"""

from __future__ import annotations

from cluster.request_state import RequestStatus, finish_reason
from decode.request import DecodeRequest
from decode.window import SlidingWindow, held_block_ids
from engine.block_allocator import BlockAllocator


class DecodeScheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_batch_size: int,
        max_seq_len: int,
        eos_token_ids: list[int],
        attention_window: int | None = None,
    ):
        self.allocator = allocator
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.eos_token_ids = list(eos_token_ids)
        self.window = SlidingWindow(allocator, attention_window) if attention_window else None
        self.requests: dict[str, DecodeRequest] = {}
        self.waiting: list[DecodeRequest] = []  # QUEUED, ordered by (priority, arrival)
        self.prefilling: dict[str, DecodeRequest] = {}  # PREFILLING
        self.running: list[DecodeRequest] = []  # DECODING

    # ---- intake -------------------------------------------------------------------
    def add(self, request: DecodeRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.order_key)

    def total_tokens(self, request: DecodeRequest) -> int:
        """The most tokens (prompt + output) the request can reach."""
        return min(request.num_prompt_tokens + request.spec.max_tokens, self.max_seq_len)

    def reserved_tokens(self, request: DecodeRequest) -> int:
        total = self.total_tokens(request)
        return total if self.window is None else self.window.reserved_tokens(request.num_prompt_tokens, total)

    def can_reserve(self, request: DecodeRequest) -> bool:
        return self.allocator.can_allocate(self.reserved_tokens(request))

    def schedule_prefills(self) -> list[DecodeRequest]:
        """Reserve blocks for waiting requests that fit; they go to a prefill worker next."""
        started = []
        while self.waiting and len(self.prefilling) < self.max_batch_size:
            request = self.waiting[0]
            if not self.can_reserve(request):
                break  # head-of-line: later requests must not starve the first
            self.waiting.pop(0)
            request.block_ids = self.allocator.allocate(self.reserved_tokens(request))
            request.status = RequestStatus.PREFILLING
            self.prefilling[request.request_id] = request
            started.append(request)
        return started

    # ---- prefill results ------------------------------------------------------------
    def on_prefill_done(self, request: DecodeRequest, first_token: int | None, error: str | None) -> str | None:
        """The prefill worker is done with this request's blocks. Returns its finish reason, if it ended."""
        self.prefilling.pop(request.request_id, None)
        if request.abort_requested:
            self._end(request, RequestStatus.ABORTED, "abort")
            return "abort"
        if first_token is None:
            request.finish_reason = "error"
            self._end(request, RequestStatus.FAILED, "error")
            return "error"
        reason = self._append(request, first_token)
        if reason is not None:
            self._end(request, RequestStatus.FINISHED, reason)
            return reason
        request.status = RequestStatus.DECODING
        self.running.append(request)
        self._slide_window(request)
        return None

    # ---- decode steps ---------------------------------------------------------------
    def schedule_decode(self) -> list[DecodeRequest]:
        """The batch for the next step (continuous batching: membership changes between steps)."""
        return self.running[: self.max_batch_size]

    def on_step(self, batch: list[DecodeRequest], token_ids: list[int]) -> list[tuple[DecodeRequest, int, str | None]]:
        """Record one step's tokens. Returns (request, output index, finish reason) per request."""
        events = []
        for request, token_id in zip(batch, token_ids):
            index = len(request.output_token_ids)
            reason = self._append(request, token_id)
            events.append((request, index, reason))
            if reason is not None:
                self.running.remove(request)
                self._end(request, RequestStatus.FINISHED, reason)
            else:
                self._slide_window(request)
        return events

    # ---- abort ----------------------------------------------------------------------
    def abort(self, request_id: str) -> DecodeRequest | None:
        """Abort a request. A PREFILLING one keeps its blocks until on_prefill_done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.abort_requested = True
        if request.status is RequestStatus.QUEUED:
            self.waiting.remove(request)
            self._end(request, RequestStatus.ABORTED, "abort")
        elif request.status is RequestStatus.DECODING:
            self.running.remove(request)
            self._end(request, RequestStatus.ABORTED, "abort")
        return request

    def fail_running(self, error: str) -> list[DecodeRequest]:
        """A step raised: end every running request (their blocks are freed)."""
        failed, self.running = self.running, []
        for request in failed:
            self._end(request, RequestStatus.FAILED, "error")
        return failed

    # ---- helpers --------------------------------------------------------------------
    def _append(self, request: DecodeRequest, token_id: int) -> str | None:
        request.output_token_ids.append(token_id)
        spec = request.spec
        return finish_reason(
            token_id,
            len(request.output_token_ids),
            request.num_tokens,
            max_tokens=spec.max_tokens,
            max_seq_len=self.max_seq_len,
            stop_token_ids=spec.stop_token_ids,
            eos_token_ids=self.eos_token_ids,
            ignore_eos=spec.ignore_eos,
        )

    def _slide_window(self, request: DecodeRequest) -> None:
        if self.window is not None:
            self.window.advance(request, self.total_tokens(request))

    def _free_blocks(self, request: DecodeRequest) -> None:
        """Give back every block the request holds (released window blocks are not held)."""
        if request.block_ids:
            self.allocator.free(held_block_ids(request))
        request.block_ids, request.spare_block_ids, request.num_released_blocks = [], [], 0

    def _end(self, request: DecodeRequest, status: RequestStatus, reason: str) -> None:
        request.status = status
        request.finish_reason = reason
        self._free_blocks(request)
        self.requests.pop(request.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.prefilling)

    @property
    def num_running(self) -> int:
        return len(self.running)
