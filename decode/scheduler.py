"""Decode-side capacity scheduler (plain Python, no torch).

Moves requests::

    QUEUED -(reserve blocks)-> [LOADING ->] PREFILLING -(KV complete)-> DECODING -> FINISHED
               ^                                                         |
               +------ PAUSED <-(no block for the next step)-------------+

and to ABORTED or FAILED from any status. Blocks are freed on every exit path;
a PREFILLING request's blocks are freed only once the prefill worker no longer
writes them (``on_prefill_done`` or the receiver's failure). Every request that
ends is reported once by ``pop_ended`` (the worker gives back its admission).

The capacity policy (``tandem.cluster.policies``; switchable between steps, applying
to admissions from then on) decides how much a request reserves and when
waiting requests may be admitted: in ``queue_key`` order, head-of-line, at
most ``max_batch_size`` active. Before each step every running request gets a
block for the token it writes (``can_grow`` / ``grow``); one admitted under
GUARANTEED_NO_EVICT or STATIC_BATCH has it already. When the pool is empty,
running requests are paused, the largest ``keep_key`` first (lowest priority,
then most recently admitted): a paused request loses its blocks and waits
ahead of the queued requests of its priority; on resume the prefill recomputes
its prompt + output tokens but the last, and decoding goes on from the last.

Sliding window (``attention_window``): after each step the blocks a request
no longer attends to are released and recycled for its later positions, so a
request reserves and holds only about a window's worth of blocks beyond its
prompt (``tandem.decode.window``).

Prefix caching (``prefix_cache``, one device running both pools: ``tandem.colocated``): the
allocator is then an ``engine.caching_allocator.CachingAllocator`` over the cache, whose free
blocks include the cached ones no request holds. At admission a request takes the cached blocks of
its longest cached prefix (``engine.prefix_cache``; never the block of its last token, which is
computed for its logits), and with a host tier under the cache the prefix goes on with blocks
copied in from host memory, beside the steps: the request waits in ``loading`` until they are in
(``land_loads``); ``num_cached_tokens`` tells its prefill where to start. The prefill
caches each prompt block as it fills; a request that stops decoding (it ends, or is paused) caches
the full blocks of its output too, so the next turn of a conversation finds its answer's KV.

LoRA: the admitted requests (prefilling and running) name at most ``max_loras`` adapters
together (``tandem.engine.lora_slots``), so every step's adapters fit the device's slots. A
request whose adapter would be one too many waits, and from then on only requests of no
adapter pass it: the admitted adapters' requests drain and its adapter gets its turn.
"""

from __future__ import annotations

from tandem.cluster.policies import GUARANTEED_NO_EVICT, capacity_policy
from tandem.cluster.request_state import RequestStatus
from tandem.decode.prefix_reuse import PrefixReuse
from tandem.decode.request import DecodeRequest
from tandem.decode.window import SlidingWindow, held_block_ids
from tandem.engine.block_allocator import BlockAllocator, blocks_for
from tandem.engine.lora_slots import AdapterSlots


class DecodeScheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_batch_size: int,
        max_seq_len: int,
        eos_token_ids: list[int],
        attention_window: int | None = None,
        policy: str = GUARANTEED_NO_EVICT,
        max_loras: int | None = None,
        swap=None,
        prefix_cache=None,
    ):
        """``swap``: a ``decode.swap.SwapSpace`` (a paused request's KV waits in host memory), or None.
        ``prefix_cache``: the ``engine.prefix_cache.PrefixCache`` ``allocator`` (a ``CachingAllocator``)
        allocates through, or None."""
        self.allocator = allocator
        # no swap with a sliding window: a paused request's released blocks hold no KV to keep
        self.swap = swap if not attention_window else None
        # nor a prefix cache: a request's blocks out of the window are recycled for later positions
        self.prefix = PrefixReuse(prefix_cache if not attention_window else None, self.swap, allocator.block_size)
        self.max_loras = max_loras  # LoRA adapters the admitted requests may name together (None: any)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.eos_token_ids = list(eos_token_ids)
        self.window = SlidingWindow(allocator, attention_window) if attention_window else None
        self.policy = capacity_policy(policy)
        self.requests: dict[str, DecodeRequest] = {}
        self.waiting: list[DecodeRequest] = []  # QUEUED and PAUSED, in queue_key order
        self.prefilling: dict[str, DecodeRequest] = {}  # PREFILLING
        self.loading: dict[str, DecodeRequest] = {}  # PREFILLING, its prefix still coming from the host tier
        self.running: list[DecodeRequest] = []  # DECODING
        self.num_preemptions = 0
        self._num_admitted = 0
        self._ended_ids: list[str] = []
        self._left_ids: list[str] = []  # left the running batch for good: ended or paused

    def set_policy(self, name: str) -> None:
        if name != self.policy.name:
            self.policy = capacity_policy(name)

    # ---- intake -------------------------------------------------------------------
    def add(self, request: DecodeRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: DecodeRequest) -> None:
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.queue_key)

    def total_tokens(self, request: DecodeRequest) -> int:
        """The most tokens (prompt + output) the request can reach."""
        return min(request.num_prompt_tokens + request.spec.max_tokens, self.max_seq_len)

    def reserved_tokens(self, request: DecodeRequest) -> int:
        """The policy's reservation (less with a sliding window); a resumed request's covers all it computed."""
        tokens = self.policy.reserve_tokens(request.num_prompt_tokens, len(request.output_token_ids),
                                           request.spec.max_tokens, self.max_seq_len)
        if self.window is not None:
            tokens = self.window.reserved_tokens(request.num_prompt_tokens, tokens)
        return max(tokens, request.num_tokens) if request.is_resuming else tokens

    def can_reserve(self, request: DecodeRequest) -> bool:
        needed = blocks_for(self.reserved_tokens(request), self.allocator.block_size)
        # a cached block it takes needs no new one, but one nobody held stops counting as free
        needed -= self.prefix.num_held(self.prefix.match(request))
        return needed + self.policy.headroom_blocks(self) <= self.allocator.num_free

    def reserve(self, request: DecodeRequest) -> None:
        num_blocks = blocks_for(self.reserved_tokens(request), self.allocator.block_size)
        cached = self.prefix.take(request)  # held from now: not evicted for the fresh blocks
        fresh = self.allocator.allocate_blocks(num_blocks - len(cached))
        request.block_ids = cached + fresh
        request.num_cached_tokens = len(cached) * self.allocator.block_size
        request.reserved_to_end = self.policy.reserves_to_end
        request.status = RequestStatus.PREFILLING
        if request.admitted_seq is None:
            self._num_admitted += 1
            request.admitted_seq = self._num_admitted
        request.host_load = self.prefix.load_host(request, len(cached), fresh)  # never a swapped-out one's
        (self.prefilling if request.host_load is None else self.loading)[request.request_id] = request

    def land_loads(self) -> list[DecodeRequest]:
        """LOADING requests (status PREFILLING, blocks reserved, no prefill yet) whose host-tier blocks
        are in (``engine.host_kv_tier.HostLoad``) -> PREFILLING with their prefix counted as cached, in
        admission order. With nothing else admitted the oldest is waited for: the device is idle."""
        landed = []
        for request in list(self.loading.values()):
            if ((not self.running and not self.prefilling and not landed) or request.host_load.done()):
                del self.loading[request.request_id]
                request.num_cached_tokens += self.prefix.landed(request.host_load) * self.allocator.block_size
                request.host_load = None
                self.prefilling[request.request_id] = request
                landed.append(request)
        return landed

    def schedule_prefills(self) -> list[DecodeRequest]:
        """Reserve blocks for waiting requests the policy admits now; they go to a prefill worker next."""
        started = self.land_loads()
        if not self.policy.may_admit(self):
            return started
        adapters = AdapterSlots(self.max_loras, self._in_prefill(), self.running)
        i = 0
        while i < len(self.waiting) and self.num_active < self.max_batch_size:
            request = self.waiting[i]
            if not adapters.admits(request.lora_key):
                i += 1  # waits for an adapter of the admitted ones to leave; others may pass
                continue
            if not self.can_reserve(request):
                break  # head-of-line: later requests must not starve the first
            self.waiting.pop(i)
            self.reserve(request)
            adapters.add(request.lora_key)
            if request.host_load is not None:
                continue  # its prefill starts once its blocks are in (land_loads)
            if request.is_resuming and self.swap is not None and self.swap.restore(request):
                self.on_prefill_done(request, None, None)  # its KV is back: it decodes on, no prefill
                continue
            started.append(request)
        return started

    # ---- prefill results ------------------------------------------------------------
    def on_prefill_done(self, request: DecodeRequest, first_token: int | None, error: str | None) -> str | None:
        """The prefill worker is done with this request's blocks. Returns its finish reason, if it ended.

        A resumed request brings no first token: decoding goes on from its last one. Nor does a
        max_tokens 0 request (its prompt only scored): it ends here, by length (the prefill
        worker sent its client the one event).
        """
        self.prefilling.pop(request.request_id, None)
        if request.abort_requested:
            self._end(request, RequestStatus.ABORTED, "abort")
            return "abort"
        if error is None and first_token is None and request.spec.max_tokens == 0:
            self._end(request, RequestStatus.FINISHED, "length")
            return "length"
        if error is not None or (first_token is None and not request.is_resuming):
            self._end(request, RequestStatus.FAILED, "error")
            return "error"
        reason = None
        if not request.is_resuming:
            reason = request.append(first_token, self.max_seq_len, self.eos_token_ids)
        if reason is not None:
            self._end(request, RequestStatus.FINISHED, reason)
            return reason
        request.status = RequestStatus.DECODING
        self.running.append(request)
        self._slide_window(request)
        return None

    # ---- decode steps ---------------------------------------------------------------
    def schedule_decode(self) -> list[DecodeRequest]:
        """The batch for the next step (continuous batching: membership changes between steps).

        Every member gets a block for the token it writes, in ``keep_key`` order;
        when none is free, requests are paused from the other end of that order.
        The step may be scheduled while the previous one is still on the device
        (``num_pending``): a request whose pending token ends it by length is left
        out; one that may stop on its pending token runs, and that row is dropped.
        """
        block_size = self.allocator.block_size
        # only a request that crosses into a new block needs one (about 1 in block_size per step)
        batch = [r for r in self.running if self._runs_next(r)]
        needy = [r for r in batch if blocks_for(r.num_scheduled_tokens, block_size) > len(r.block_ids)]
        sitting_out = set()
        for request in sorted(needy, key=lambda r: r.keep_key):
            if request.status is not RequestStatus.DECODING:
                continue
            room = self._make_room(request)
            if room:
                self.grow(request)
            elif room is None:
                sitting_out.add(request.request_id)
        return [r for r in batch if r.status is RequestStatus.DECODING
                and r.request_id not in sitting_out][: self.max_batch_size]

    def _runs_next(self, request: DecodeRequest) -> bool:
        """Not when its pending token already ends it by length."""
        return not (request.num_pending and self._ends_by_length(request))

    def can_schedule_ahead(self) -> bool:
        """Whether the next step can be scheduled before the one on the device is read:
        every running request's next block is free now. Otherwise someone would be
        paused, and its blocks would only come back once the step on the device is read."""
        return self.num_growth_blocks() <= self.allocator.num_free

    def _ends_by_length(self, request: DecodeRequest) -> bool:
        """Whether the request's pending tokens bring it to max_tokens or max_seq_len."""
        num_outputs = len(request.output_token_ids) + request.num_pending
        return (num_outputs >= request.spec.max_tokens
                or request.num_scheduled_tokens >= self.max_seq_len)

    def can_grow(self, request: DecodeRequest) -> bool:
        return self.allocator.can_append(request.block_ids, request.num_scheduled_tokens)

    def grow(self, request: DecodeRequest) -> None:
        self.allocator.append(request.block_ids, request.num_scheduled_tokens)

    def pause(self, request: DecodeRequest) -> None:
        """Preempt a running request: its blocks go back; its KV is recomputed when it resumes, or
        with a swap space copied to host memory now and back then."""
        self.running.remove(request)
        if self.swap is not None:
            self.swap.save(request)  # its KV to host memory first: the blocks are free after
        self.prefix.cache_output(request)
        self._free_blocks(request)
        request.status = RequestStatus.PAUSED
        request.num_pending = 0  # a token still on the device is dropped: the resume recomputes it
        self._left_ids.append(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _make_room(self, request: DecodeRequest) -> bool | None:
        """Pause requests until ``request`` can grow: True when it can; False if it had to be paused
        itself; None when the newest holder of blocks is a request still in prefill (it cannot give
        them up): ``request`` sits this step out rather than see an older request paused for it."""
        while not self.can_grow(request):
            victim = max(self.running, key=lambda r: r.keep_key)
            if any(r.keep_key > victim.keep_key for r in self._in_prefill()):
                return None
            self.pause(victim)
            if victim is request:
                return False
        return True

    def num_unreserved_blocks(self) -> int:
        """Blocks the active requests still need to reach their end beyond what they hold: what the
        requests admitted under MAX_UTILIZATION still grow by (after a live switch to a reserving
        policy; those it admitted itself hold all theirs, and are not even looked at)."""
        block_size = self.allocator.block_size
        return sum(max(blocks_for(self.reserved_tokens(r), block_size) - len(held_block_ids(r)), 0)
                   for r in (*self._in_prefill(), *self.running) if not r.reserved_to_end)

    def _in_prefill(self) -> list[DecodeRequest]:
        """PREFILLING requests, LOADING ones included: their blocks reserved, not yet decoding."""
        return [*self.prefilling.values(), *self.loading.values()]

    def num_growth_blocks(self) -> int:
        """Blocks the running requests still need for their next step."""
        block_size = self.allocator.block_size
        return sum(max(blocks_for(r.num_scheduled_tokens, block_size) - len(r.block_ids), 0)
                   for r in self.running if self._runs_next(r))

    def on_step(
        self, batch: list[DecodeRequest], token_ids: list[int], indices: list[int] | None = None
    ) -> list[tuple[DecodeRequest, int, str | None]]:
        """Record one step's tokens. Returns (request, output index, finish reason) per request kept.

        ``indices``: the output index each row sampled, as launched. A row whose request
        ended or was paused since, or expects another index, is dropped (its step was
        scheduled before the request's previous token was known).
        """
        events = []
        for row, (request, token_id) in enumerate(zip(batch, token_ids)):
            index = len(request.output_token_ids)
            if indices is not None and (request.status is not RequestStatus.DECODING or indices[row] != index):
                if request.status is RequestStatus.DECODING:
                    request.num_pending = 0  # out of step with the device: feed its last known token next
                continue
            request.num_pending = max(request.num_pending - 1, 0)
            reason = request.append(token_id, self.max_seq_len, self.eos_token_ids)
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
        if request.status in (RequestStatus.QUEUED, RequestStatus.PAUSED):
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
    def _slide_window(self, request: DecodeRequest) -> None:
        if self.window is not None:
            self.window.advance(request, self.total_tokens(request))

    def _free_blocks(self, request: DecodeRequest) -> None:
        """Give back every block the request holds (released window blocks are not held)."""
        if request.block_ids:
            self.allocator.free(held_block_ids(request))
        request.block_ids, request.spare_block_ids, request.num_released_blocks = [], [], 0

    def _end(self, request: DecodeRequest, status: RequestStatus, reason: str) -> None:
        if self.swap is not None:
            self.swap.discard(request.request_id)
        if request.status is RequestStatus.DECODING and status is not RequestStatus.FAILED:
            self.prefix.cache_output(request)  # not after an engine error: its last step's KV is in doubt
        request.status = status
        request.finish_reason = reason
        self._free_blocks(request)
        self.requests.pop(request.request_id, None)
        self._ended_ids.append(request.request_id)
        self._left_ids.append(request.request_id)

    def pop_ended(self) -> list[str]:
        """Ids of the requests that ended (any status) since the last call."""
        ended, self._ended_ids = self._ended_ids, []
        return ended

    def pop_left_batch(self) -> list[str]:
        """Ids of the requests that ended or were paused since the last call: what a step kept
        on the device for them (penalty counts) is dropped; a resumed request starts over from
        the tokens known on the host."""
        left, self._left_ids = self._left_ids, []
        return left

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading) + len(self.prefilling)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_active(self) -> int:
        """Requests holding blocks for their own use: PREFILLING (LOADING too) and DECODING."""
        return len(self.prefilling) + len(self.loading) + len(self.running)
