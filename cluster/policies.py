"""Scheduling policies (TensorRT-LLM's names): every rule in one torch-free registry.

Capacity policies: what a decode worker reserves for a request, when it admits,
and what admission must leave free. The decode scheduler asks them (through the
narrow ``CapacityView``), the gateways' admission charges a request by the same
reservation rule, settings and the admin API take their names from here.

    GUARANTEED_NO_EVICT  reserve prompt + max_tokens (capped at max_seq_len)
                         before the prefill: a request admitted under it never
                         needs another block and is never paused.
    MAX_UTILIZATION      reserve what is computed so far + 1 token (prompt + 1
                         for a new request); blocks are added step by step, and
                         when the pool runs out the scheduler pauses requests.
                         Admission keeps back the blocks the running requests
                         need for their next step, so a newcomer does not take
                         them from an older request; the newest holder is paused
                         first, and while that is a request still in prefill
                         (its blocks cannot be taken back) the request needing a
                         block sits the step out instead of an older one pausing.
    STATIC_BATCH         reserve as GUARANTEED_NO_EVICT, but admit only while no
                         request is active: a batch is formed from the waiting
                         requests (as many as fit, up to max_batch_size), runs to
                         completion, and only then is the next one formed.

Context chunking policies: how a prefill worker splits one forward's token
budget over the prompts in flight. A chunk that is not a job's last is a whole
number of blocks, so every chunk starts on a block boundary.

    FIRST_COME_FIRST_SERVED  the earliest job takes as much of the budget as it
                             can use, then the next, and so on.
    EQUAL_PROGRESS           jobs take one block each in turn, round after round,
                             while the budget lasts (a job whose next block does
                             not fit is passed over; the rest go on).

Policies are stateless. Adding one is a class with the ``register_*`` decorator
and its test (and, for the admin API, a value in ``gateway/admin.proto``'s enum,
which a test checks against this registry).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, TypeVar

GUARANTEED_NO_EVICT, MAX_UTILIZATION, STATIC_BATCH = "GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"
FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS = "FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"


class CapacityView(Protocol):
    """What a capacity policy may ask of the scheduler that applies it."""

    @property
    def num_active(self) -> int: ...  # requests in prefill or running

    def num_unreserved_blocks(self) -> int: ...  # blocks active requests still grow into beyond what they hold

    def num_growth_blocks(self) -> int: ...  # blocks the running requests need for their next step


class CapacityPolicy:
    name: ClassVar[str]
    reserves_to_end: ClassVar[bool] = True  # a request it admits holds every block it will need

    def reserve_tokens(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                       max_seq_len: int) -> int:
        """Tokens of KV reserved when a request is admitted (or resumed): the most it can reach."""
        return min(num_prompt_tokens + max_tokens, max_seq_len)

    def charge_tokens(self, num_prompt_tokens: int, max_tokens: int, max_seq_len: int, block_size: int,
                      capacity_tokens: int) -> int:
        """What admitting a new request costs a worker (the gateways' admission): its reservation in
        whole blocks, at most the whole pool."""
        tokens = self.reserve_tokens(num_prompt_tokens, 0, max_tokens, max_seq_len or num_prompt_tokens + max_tokens)
        block_size = max(block_size, 1)
        return min(-(-tokens // block_size) * block_size, capacity_tokens)

    def may_admit(self, view: CapacityView) -> bool:
        return True

    def headroom_blocks(self, view: CapacityView) -> int:
        """Free blocks admission must leave untouched: what the active requests still need to
        finish (none but after a live switch from MAX_UTILIZATION: then a newcomer admitted
        here must not take the blocks those requests grow into, and be paused for them)."""
        return view.num_unreserved_blocks()


class ChunkingPolicy:
    name: ClassVar[str]

    def chunk_sizes(self, remaining: list[int], budget: int, unit: int) -> list[int]:
        """Tokens each job (in admission order, ``remaining`` still to compute) computes in the next
        forward of at most ``budget`` tokens; a chunk that is not a job's last is a multiple of ``unit``."""
        raise NotImplementedError


CAPACITY_POLICIES: dict[str, CapacityPolicy] = {}
CHUNKING_POLICIES: dict[str, ChunkingPolicy] = {}
_C = TypeVar("_C", bound=type[CapacityPolicy])
_K = TypeVar("_K", bound=type[ChunkingPolicy])


def register_capacity(cls: _C) -> _C:
    CAPACITY_POLICIES[cls.name] = cls()
    return cls


def register_chunking(cls: _K) -> _K:
    CHUNKING_POLICIES[cls.name] = cls()
    return cls


@register_capacity
class GuaranteedNoEvict(CapacityPolicy):
    name = GUARANTEED_NO_EVICT


@register_capacity
class MaxUtilization(CapacityPolicy):
    name = MAX_UTILIZATION
    reserves_to_end = False

    def reserve_tokens(self, num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                       max_seq_len: int) -> int:
        """What is computed so far + the token the next step writes."""
        return min(num_prompt_tokens + max(num_output_tokens, 1), max_seq_len)

    def headroom_blocks(self, view: CapacityView) -> int:
        return view.num_growth_blocks()


@register_capacity
class StaticBatch(CapacityPolicy):
    name = STATIC_BATCH

    def may_admit(self, view: CapacityView) -> bool:
        return view.num_active == 0


@register_chunking
class FirstComeFirstServed(ChunkingPolicy):
    name = FIRST_COME_FIRST_SERVED

    def chunk_sizes(self, remaining: list[int], budget: int, unit: int) -> list[int]:
        """Each job in turn takes what is left of the budget, its last chunk whole, any other rounded
        down to a multiple of ``unit`` (0: passed over this forward)."""
        sizes = []
        for need in remaining:
            size = min(need, budget)
            if size < need:
                size -= size % unit
            sizes.append(size)
            budget -= size
        return sizes


@register_chunking
class EqualProgress(ChunkingPolicy):
    name = EQUAL_PROGRESS

    def chunk_sizes(self, remaining: list[int], budget: int, unit: int) -> list[int]:
        """Round after round, each job takes its next ``unit`` tokens (its last, possibly shorter,
        increment at the end) if they fit in what is left of the budget."""
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


CAPACITY_POLICY_NAMES = tuple(CAPACITY_POLICIES)
CHUNKING_POLICY_NAMES = tuple(CHUNKING_POLICIES)


def capacity_policy(name: str) -> CapacityPolicy:
    try:
        return CAPACITY_POLICIES[name]
    except KeyError:
        raise ValueError(f"capacity scheduler policy must be one of {CAPACITY_POLICY_NAMES}, got {name!r}") from None


def chunking_policy(name: str) -> ChunkingPolicy:
    try:
        return CHUNKING_POLICIES[name]
    except KeyError:
        raise ValueError(f"context chunking policy must be one of {CHUNKING_POLICY_NAMES}, got {name!r}") from None
