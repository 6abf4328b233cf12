"""Prefill-side chunked-context scheduler (plain Python, no torch).

Moves jobs: QUEUED -(local blocks allocated)-> PREFILLING (one chunk per
forward, at most ``max_num_tokens`` tokens per forward over all jobs) ->
TRANSFERRING (last chunk done, first token sampled, KV writes draining) ->
FINISHED | ABORTED | FAILED, freeing the local blocks on every exit.

Chunking policies:
    FIRST_COME_FIRST_SERVED  the earliest job takes as much of the budget as it
                             can use before the next job gets any.
    EQUAL_PROGRESS           every prefilling job gets one chunk in turn: the
                             budget is split evenly (in whole blocks) over them.
"""

from __future__ import annotations

from cluster.request_state import RequestStatus
from engine.block_allocator import BlockAllocator
from prefill.job import PrefillState

POLICIES = ("FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS")


class PrefillScheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_tokens: int,
        max_batch_size: int,
        policy: str = "FIRST_COME_FIRST_SERVED",
    ):
        if policy not in POLICIES:
            raise ValueError(f"context chunking policy must be one of {POLICIES}, got {policy!r}")
        self.allocator = allocator
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.policy = policy
        self.jobs: dict[str, PrefillState] = {}
        self.waiting: list[PrefillState] = []  # QUEUED
        self.prefilling: list[PrefillState] = []  # PREFILLING, in admission order
        self.transferring: list[PrefillState] = []  # TRANSFERRING

    def add(self, state: PrefillState) -> None:
        if state.request_id in self.jobs:
            raise ValueError(f"duplicate request id {state.request_id}")
        self.jobs[state.request_id] = state
        self.waiting.append(state)
        self.waiting.sort(key=lambda s: s.order_key)

    def schedule(self) -> list[tuple[PrefillState, int]]:
        """(job, number of prompt tokens to compute now) for the next forward."""
        self._admit()
        if not self.prefilling:
            return []
        if self.policy == "EQUAL_PROGRESS":
            return self._equal_progress()
        chunks, budget = [], self.max_num_tokens
        for state in self.prefilling:
            if budget == 0:
                break
            num_tokens = min(state.num_remaining, budget)
            chunks.append((state, num_tokens))
            budget -= num_tokens
        return chunks

    def _equal_progress(self) -> list[tuple[PrefillState, int]]:
        block_size = self.allocator.block_size
        share = max(self.max_num_tokens // len(self.prefilling) // block_size * block_size, block_size)
        chunks, budget = [], self.max_num_tokens
        for state in self.prefilling:
            num_tokens = min(state.num_remaining, share, budget)
            if num_tokens == 0:
                break
            chunks.append((state, num_tokens))
            budget -= num_tokens
        return chunks

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) < self.max_batch_size:
            state = self.waiting[0]
            if not self.allocator.can_allocate(state.num_prompt_tokens):
                break
            self.waiting.pop(0)
            state.block_ids = self.allocator.allocate(state.num_prompt_tokens)
            state.status = RequestStatus.PREFILLING
            self.prefilling.append(state)

    def on_chunk_done(self, state: PrefillState, num_tokens: int) -> bool:
        """Record a computed chunk; True when the whole prompt is now computed."""
        state.num_computed += num_tokens
        if state.num_remaining > 0:
            return False
        self.prefilling.remove(state)
        state.status = RequestStatus.TRANSFERRING
        self.transferring.append(state)
        return True

    def finish(self, state: PrefillState, status: RequestStatus) -> None:
        """End a job: its local blocks go back and the worker forgets it."""
        for queue in (self.waiting, self.prefilling, self.transferring):
            if state in queue:
                queue.remove(state)
        if state.block_ids:
            self.allocator.free(state.block_ids)
            state.block_ids = []
        state.status = status
        self.jobs.pop(state.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.transferring)
