"""Prefill-side chunked-context scheduler (plain Python, no torch).

Moves jobs: QUEUED -(local blocks allocated)-> PREFILLING (one chunk per
forward, at most ``max_num_tokens`` tokens per forward over all jobs) ->
TRANSFERRING (last chunk done, first token sampled, KV writes draining) ->
FINISHED | ABORTED | FAILED, freeing the local blocks on every exit.

Prefix caching (``tandem.engine.prefix_cache``): at admission a job takes the cached
blocks of its longest cached prefix (never the block of its last token, whose
logits are needed) and starts computing after them (a job computing its prompt
logprobs takes none: it needs every position's logits); every block that becomes
full is cached. With a host tier under the cache, the prefix may go on in host memory: those
blocks are copied into the job's fresh blocks and count as cached too. The copy runs beside the
forwards (``engine.host_kv_tier.HostLoad``): the job waits in ``loading`` until its blocks are in,
then joins the prefilling jobs (a forward with nothing else to compute waits for the oldest such
copy instead of running empty). Sliding window: between
chunks, blocks no later query of the prompt attends to are given back (``release_out_of_window``).

LoRA: the jobs in prefill name at most ``max_loras`` adapters together, so that every forward's
adapters fit the device slots (``tandem.engine.lora_slots``); a job's prefix-cache hashes start
from its adapter's digest, so two adapters never share KV.

Chunking policies: ``tandem.cluster.policies`` (FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS).

A job whose blocks are lent (``PrefillState.borrowed``: one device running both pools) is
admitted with them as they are and never caches or frees them; ``max_num_tokens`` is then
the part of each step's token budget the decode rows leave (``tandem.colocated``).
"""

from __future__ import annotations

from tandem.cluster.policies import FIRST_COME_FIRST_SERVED, chunking_policy
from tandem.cluster.request_state import RequestStatus
from tandem.engine.block_allocator import BlockAllocator, blocks_for
from tandem.engine.lora_slots import AdapterSlots
from tandem.cluster.block_hashes import block_hashes, num_reusable_blocks
from tandem.engine.prefix_cache import PrefixCache
from tandem.prefill.job import PrefillState

class PrefillScheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_tokens: int,
        max_batch_size: int,
        policy: str = FIRST_COME_FIRST_SERVED,
        prefix_cache: PrefixCache | None = None,
        attention_window: int | None = None,
        max_loras: int | None = None,
    ):
        self.allocator = allocator
        self.max_loras = max_loras  # LoRA adapters the jobs in prefill may name together (None: any)
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.policy = chunking_policy(policy)
        self.cache = prefix_cache or PrefixCache(allocator, enabled=False)
        self.attention_window = attention_window  # None: every layer attends to the whole prompt
        self.jobs: dict[str, PrefillState] = {}
        self.waiting: list[PrefillState] = []  # QUEUED
        self.prefilling: list[PrefillState] = []  # PREFILLING, in admission order
        self.loading: list[PrefillState] = []  # PREFILLING, their prefix still coming from the host tier
        self.transferring: list[PrefillState] = []  # TRANSFERRING
        self.num_device_hit_blocks = 0  # prompt blocks taken from the device prefix cache (running total)

    def set_policy(self, name: str) -> None:
        """Switch the chunking policy (between forwards: the next chunk is planned under it)."""
        if name != self.policy.name:
            self.policy = chunking_policy(name)

    def add(self, state: PrefillState) -> None:
        if state.request_id in self.jobs:
            raise ValueError(f"duplicate request id {state.request_id}")
        self.jobs[state.request_id] = state
        if self.cache.enabled and not state.block_hashes:  # a borrowed job's came with it
            # an adapter's KV is its own: the chain starts from its digest (engine.prefix_cache)
            state.block_hashes = block_hashes(state.job.prompt_token_ids, self.allocator.block_size,
                                              salt=state.job.lora_digest)
        self.waiting.append(state)
        self.waiting.sort(key=lambda s: s.order_key)

    def schedule(self) -> list[tuple[PrefillState, int]]:
        """(job, number of prompt tokens to compute now) for the next forward."""
        self._admit()
        self._land(wait=not self.prefilling)
        if not self.prefilling:
            return []
        remaining = [state.num_remaining for state in self.prefilling]
        sizes = self.policy.chunk_sizes(remaining, self.max_num_tokens, self.allocator.block_size)
        return [(state, n) for state, n in zip(self.prefilling, sizes) if n > 0]

    def _admit(self) -> None:
        block_size = self.allocator.block_size
        adapters = AdapterSlots(self.max_loras, self.prefilling + self.loading)
        i = 0
        while i < len(self.waiting) and len(self.prefilling) + len(self.loading) < self.max_batch_size:
            state = self.waiting[i]
            if state.borrowed:  # its blocks came with it (and its adapter was admitted with them)
                self.waiting.pop(i)
                state.status = RequestStatus.PREFILLING
                self.prefilling.append(state)
                continue
            if not adapters.admits(state.lora_key):
                i += 1  # waits for an adapter of the jobs in prefill to leave; others may pass
                continue
            # a job scoring its prompt takes no cached blocks: their positions would have no logits
            cached = [] if state.scores_prompt else self.cache.match(
                state.block_hashes[: num_reusable_blocks(state.num_prompt_tokens, block_size)])
            self.cache.acquire(cached)  # first: the matched blocks must not be evicted for the rest
            num_new = blocks_for(state.num_prompt_tokens, block_size) - len(cached)
            if not self.cache.can_allocate(num_new):
                self.cache.release(cached)
                break
            self.waiting.pop(i)
            adapters.add(state.lora_key)
            fresh = self.cache.allocate(num_new)
            # the prefix may go on in the host tier: those blocks are copied in instead of computed
            after = state.block_hashes[len(cached) : num_reusable_blocks(state.num_prompt_tokens, block_size)]
            num_host = 0 if state.scores_prompt else self.cache.match_host(after)
            state.host_load = self.cache.load_host(after[:num_host], fresh)
            self.num_device_hit_blocks += len(cached)
            state.block_ids = cached + fresh
            state.num_cached_tokens = state.num_computed = len(cached) * block_size
            state.status = RequestStatus.PREFILLING
            (self.prefilling if state.host_load is None else self.loading).append(state)

    def _land(self, wait: bool) -> None:
        """Jobs whose host-tier blocks are in join the prefilling ones, in admission order; with
        ``wait``, the oldest is waited for."""
        oldest = self.loading[0] if wait and self.loading else None
        for state in list(self.loading):
            if state is oldest or state.host_load.done():
                self._take_load(state)

    def _take_load(self, state: PrefillState) -> None:
        loaded = self.cache.landed(state.host_load)
        state.host_load = None
        state.num_host_cached_tokens = loaded * self.allocator.block_size
        state.num_cached_tokens = state.num_computed = state.num_cached_tokens + state.num_host_cached_tokens
        self.loading.remove(state)
        if state.status is RequestStatus.PREFILLING:
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
        if self.attention_window is None or state.status is not RequestStatus.PREFILLING or state.borrowed:
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
        """End a job: its local blocks go back (once a copy from the host tier into them is done)
        and the worker forgets it."""
        if state.host_load is not None:
            state.status = status
            self._take_load(state)
        for queue in (self.waiting, self.prefilling, self.transferring):
            if state in queue:
                queue.remove(state)
        if state.block_ids and not state.borrowed:
            self.cache.release(state.block_ids[state.num_released_blocks :])
        state.block_ids = []
        state.status = status
        self.jobs.pop(state.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.loading) + len(self.transferring)
