"""A prefill job as the prefill worker holds it (plain Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.cluster.messages import PrefillJob
from tandem.cluster.request_state import RequestStatus


@dataclass
class PrefillState:
    job: PrefillJob
    status: RequestStatus = RequestStatus.QUEUED
    block_ids: list[int] = field(default_factory=list)  # in this worker's own pool
    # the blocks are lent by the pool's owner (the decode side, on one device: tandem.colocated):
    # given at the start, computed into directly, never allocated, cached or freed here
    borrowed: bool = False
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the prompt's full blocks
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_host_cached_tokens: int = 0  # of those, the ones copied in from the host KV tier
    host_load: object | None = None  # engine.host_kv_tier.HostLoad of its prefix, while in flight
    num_released_blocks: int = 0  # leading blocks out of the attention window, given back already
    sender: object | None = None  # kvtransfer.KVSender
    first_token: int | None = None
    finish_reason: str | None = None
    # with scores_prompt: one engine.prompt_logprobs entry per prompt token computed so far
    prompt_logprobs: list | None = None
    # set when the job was given up (abort, engine error) while writes were in flight:
    # the PrefillDone status and error to send once they have drained
    abandoned: tuple[str, str | None] | None = None
    lora_key: str | None = None  # its LoRA adapter as the worker's LoraManager holds it (engine.lora_loads)

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.job.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own logprobs are computed (asked for; a resumed job computes none)."""
        return self.job.sampling.prompt_logprobs is not None and not self.job.resume

    @property
    def num_remaining(self) -> int:
        return self.num_prompt_tokens - self.num_computed

    @property
    def order_key(self) -> tuple[int, float]:
        return (self.job.priority, self.job.arrival_time)
