"""Prefill-side chunked-context scheduler (plain Python, no torch).

Moves jobs: QUEUED -(local blocks allocated)-> PREFILLING (one chunk per
forward, at most ``max_num_tokens`` tokens per forward over all jobs) ->
TRANSFERRING (last chunk done, first token sampled, KV writes draining) ->
FINISHED | ABORTED | FAILED, freeing the local blocks on every exit.

Prefix caching (``engine.prefix_cache``): at admission a job takes the cached
blocks of its longest cached prefix (never the block of its last token, whose
logits are needed) and starts computing after them; every block that becomes
full is cached. Sliding window: between chunks, blocks no later query of the
prompt attends to are given back (``release_out_of_window``).

Chunking policies (TensorRT-LLM's): a chunk that is not a job's last is a whole
number of blocks, so every chunk starts on a block boundary.
    FIRST_COME_FIRST_SERVED  the earliest job takes as much of the budget as it
                             can use, then the next, and so on.
    EQUAL_PROGRESS           jobs take one block each in turn, round after round,
                             while the budget lasts (a job whose next block does
                             not fit is passed over; the rest go on).
"""

from __future__ import annotations

from tandem.cluster.request_state import RequestStatus
from tandem.engine.block_allocator import BlockAllocator, blocks_for
from tandem.engine.prefix_cache import PrefixCache, block_hashes, num_reusable_blocks
from tandem.prefill.job import PrefillState

POLICIES = ("FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS")


class PrefillScheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_tokens: int,
        max_batch_size: int,
        policy: str = "FIRST_COME_FIRST_SERVED",
        prefix_cache: PrefixCache | None = None,
        attention_window: int | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"context chunking policy must be one of {POLICIES}, got {policy!r}")
        self.allocator = allocator
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.policy = policy
        self.cache = prefix_cache or PrefixCache(allocator, enabled=False)
        self.attention_window = attention_window  # None: every layer attends to the whole prompt
        self.jobs: dict[str, PrefillState] = {}
        self.waiting: list[PrefillState] = []  # QUEUED
        self.prefilling: list[PrefillState] = []  # PREFILLING, in admission order
        self.transferring: list[PrefillState] = []  # TRANSFERRING

    def add(self, state: PrefillState) -> None:
        if state.request_id in self.jobs:
            raise ValueError(f"duplicate request id {state.request_id}")
        self.jobs[state.request_id] = state
        if self.cache.enabled:
            state.block_hashes = block_hashes(state.job.prompt_token_ids, self.allocator.block_size)
        self.waiting.append(state)
        self.waiting.sort(key=lambda s: s.order_key)

    def schedule(self) -> list[tuple[PrefillState, int]]:
        """(job, number of prompt tokens to compute now) for the next forward."""
        self._admit()
        if not self.prefilling:
            return []
        remaining = [state.num_remaining for state in self.prefilling]
        if self.policy == "EQUAL_PROGRESS":
            sizes = equal_progress_chunks(remaining, self.max_num_tokens, self.allocator.block_size)
        else:
            sizes = first_come_chunks(remaining, self.max_num_tokens, self.allocator.block_size)
        return [(state, n) for state, n in zip(self.prefilling, sizes) if n > 0]

    def _admit(self) -> None:
        block_size = self.allocator.block_size
        while self.waiting and len(self.prefilling) < self.max_batch_size:
            state = self.waiting[0]
            cached = self.cache.match(state.block_hashes[: num_reusable_blocks(state.num_prompt_tokens, block_size)])
            self.cache.acquire(cached)  # first: the matched blocks must not be evicted for the rest
            num_new = blocks_for(state.num_prompt_tokens, block_size) - len(cached)
            if not self.cache.can_allocate(num_new):
                self.cache.release(cached)
                break
            self.waiting.pop(0)
            state.block_ids = cached + self.cache.allocate(num_new)
            state.num_cached_tokens = state.num_computed = len(cached) * block_size
            state.status = RequestStatus.PREFILLING
            self.prefilling.append(state)

    def on_chunk_done(self, state: PrefillState, num_tokens: int) -> bool:
        """Record a computed chunk (caching the blocks it filled); True when the whole prompt is computed."""
        first_filled = state.num_computed // self.allocator.block_size
        state.num_computed += num_tokens
        last_filled = min(state.num_computed // self.allocator.block_size, len(state.block_hashes))
        for index in range(first_filled, last_filled):
            self.cache.insert(state.block_hashes[index], state.block_ids[index])
        if state.num_remaining > 0:
            return False
        self.prefilling.remove(state)
        state.status = RequestStatus.TRANSFERRING
        self.transferring.append(state)
        return True

    def release_out_of_window(self, state: PrefillState) -> int:
        """Give back the leading blocks of a PREFILLING job that no later query attends to; how many.

        The caller makes sure no transfer still reads them.
        """
        if self.attention_window is None or state.status is not RequestStatus.PREFILLING:
            return 0
        # the next chunk's first query sits at num_computed and reads keys from num_computed - window + 1 on
        end = max(state.num_computed - self.attention_window + 1, 0) // self.allocator.block_size
        start = state.num_released_blocks
        if end <= start:
            return 0
        self.cache.release(state.block_ids[start:end])
        state.num_released_blocks = end
        return end - start

    def drain(self, state: PrefillState) -> None:
        """Compute no more of a PREFILLING job; it waits in TRANSFERRING (keeping its blocks,
        which in-flight writes still read) until its writes are done."""
        if state in self.prefilling:
            self.prefilling.remove(state)
            state.status = RequestStatus.TRANSFERRING
            self.transferring.append(state)

    def finish(self, state: PrefillState, status: RequestStatus) -> None:
        """End a job: its local blocks go back and the worker forgets it."""
        for queue in (self.waiting, self.prefilling, self.transferring):
            if state in queue:
                queue.remove(state)
        if state.block_ids:
            self.cache.release(state.block_ids[state.num_released_blocks :])
            state.block_ids = []
        state.status = status
        self.jobs.pop(state.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.transferring)


def first_come_chunks(remaining: list[int], budget: int, unit: int) -> list[int]:
    """FIRST_COME_FIRST_SERVED: each job in turn takes what is left of the budget, its last chunk
    whole, any other rounded down to a multiple of ``unit`` (0: passed over this forward)."""
    sizes = []
    for need in remaining:
        size = min(need, budget)
        if size < need:
            size -= size % unit
        sizes.append(size)
        budget -= size
    return sizes


def equal_progress_chunks(remaining: list[int], budget: int, unit: int) -> list[int]:
    """EQUAL_PROGRESS: round after round, each job takes its next ``unit`` tokens (its last,
    possibly shorter, increment at the end) if they fit in what is left of the budget."""
    def after_rounds(r: int) -> int:  # tokens handed out by r whole rounds
        return sum(min(need, r * unit) for need in remaining)

    lo, hi = 0, max(remaining, default=0) // unit + 1  # the most whole rounds that fit: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if after_rounds(mid) <= budget else (lo, mid - 1)
    sizes = [min(need, lo * unit) for need in remaining]
    budget -= sum(sizes)
    progress = True
    while progress:  # the round that no longer fits whole, as far as it goes (few rounds: budget < a round)
        progress = False
        for i, need in enumerate(remaining):
            step = min(unit, need - sizes[i])
            if 0 < step <= budget:
                sizes[i] += step
                budget -= step
                progress = True
    return sizes
