"""Capacity scheduler policies (TensorRT-LLM's names): what a decode worker reserves, and when it admits.

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

Policies are stateless; ``DecodeScheduler`` asks them and keeps all state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.cluster.admission import GUARANTEED_NO_EVICT, MAX_UTILIZATION, STATIC_BATCH, reserve_tokens
from tandem.decode.request import DecodeRequest

if TYPE_CHECKING:
    from tandem.decode.scheduler import DecodeScheduler


class GuaranteedNoEvict:
    name = GUARANTEED_NO_EVICT
    reserves_to_end = True  # a request it admits holds every block it will need

    def reserve_tokens(self, request: DecodeRequest, max_seq_len: int) -> int:
        return reserve_tokens(self.name, request.num_prompt_tokens, len(request.output_token_ids),
                              request.spec.max_tokens, max_seq_len)

    def may_admit(self, scheduler: "DecodeScheduler") -> bool:
        return True

    def headroom_blocks(self, scheduler: "DecodeScheduler") -> int:
        """Free blocks admission must leave untouched: what the active requests still need to
        finish (none but after a live switch from MAX_UTILIZATION: then a newcomer admitted
        here must not take the blocks those requests grow into, and be paused for them)."""
        return scheduler.num_unreserved_blocks()


class MaxUtilization(GuaranteedNoEvict):
    name = MAX_UTILIZATION
    reserves_to_end = False

    def headroom_blocks(self, scheduler: "DecodeScheduler") -> int:
        return scheduler.num_growth_blocks()


class StaticBatch(GuaranteedNoEvict):
    name = STATIC_BATCH

    def may_admit(self, scheduler: "DecodeScheduler") -> bool:
        return scheduler.num_active == 0


POLICIES = {policy.name: policy for policy in (GuaranteedNoEvict(), MaxUtilization(), StaticBatch())}


def get_policy(name: str) -> GuaranteedNoEvict:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"capacity scheduler policy must be one of {tuple(POLICIES)}, got {name!r}") from None
