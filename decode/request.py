"""A request as the decode worker holds it (plain Python), and the token events its steps send."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.cluster.messages import GenerateRequest, TokenEvent
from tandem.cluster.request_state import RequestStatus, finish_reason


@dataclass
class DecodeRequest:
    spec: GenerateRequest
    status: RequestStatus = RequestStatus.QUEUED
    block_ids: list[int] = field(default_factory=list)  # the block table, by position // block_size
    # sliding window: leading table entries out of the window (given back; never read or written again)
    num_released_blocks: int = 0
    spare_block_ids: list[int] = field(default_factory=list)  # released blocks kept for later positions
    output_token_ids: list[int] = field(default_factory=list)
    num_pending: int = 0  # tokens sampled by the step on the device, not yet in output_token_ids
    prefill_worker_id: str | None = None
    prefill_started_at: float | None = None  # that worker's incarnation (WorkerInfo.started_at) at dispatch
    prefill_pid: int | None = None  # its process, when it runs on this host (decode.quarantine)
    receiver: object | None = None  # kvtransfer.KVReceiver while PREFILLING
    handoff_id: str | None = None  # the current dispatch's grant on our pool while PREFILLING
    dispatch_id: str | None = None  # the latest PrefillJob's handoff_id: only its PrefillDone answers it
    dispatched_at: float | None = None  # time.monotonic() of the current dispatch to a prefill worker
    abort_requested: bool = False
    finish_reason: str | None = None
    admitted_seq: int | None = None  # order of first admission (later = preempted first)
    reserved_to_end: bool = False  # its last admission reserved every block it will need
    num_preemptions: int = 0
    guide: object | None = None  # engine.guide.Guide of a structured output, once in a decode step
    lora_key: str | None = None  # its LoRA adapter as the worker's LoraManager holds it (engine.lora_loads)
    # with a prefix cache (one device running both pools): the chained hashes of the full blocks of
    # prefill_token_ids, and how many of its tokens' KV came from the cache at its last admission
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    host_load: object | None = None  # engine.host_kv_tier.HostLoad of its prefix, while in flight (LOADING)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens including those still on the device: the next step writes position this - 1."""
        return self.num_tokens + self.num_pending

    @property
    def prefill_token_ids(self) -> list[int]:
        """The tokens its prefill computes: the prompt; when resuming, the prompt and every output token
        but the last (decoding goes on from that one)."""
        if self.is_resuming:
            return self.spec.prompt_token_ids + self.output_token_ids[:-1]
        return self.spec.prompt_token_ids

    @property
    def is_resuming(self) -> bool:
        """Admitted again after a pause: the prefill recomputes prompt + output tokens but the last."""
        return bool(self.output_token_ids)

    def append(self, token_id: int, max_seq_len: int, eos_token_ids) -> str | None:
        """Take ``token_id`` as its next output token -> why that ends it, or None."""
        self.output_token_ids.append(token_id)
        spec = self.spec
        return finish_reason(token_id, len(self.output_token_ids), self.num_tokens, max_tokens=spec.max_tokens,
                             max_seq_len=max_seq_len, stop_token_ids=spec.stop_token_ids,
                             eos_token_ids=eos_token_ids, ignore_eos=spec.ignore_eos,
                             min_tokens=spec.sampling.min_tokens)

    @property
    def queue_key(self) -> tuple[int, bool, float]:
        """Waiting order: priority, then paused requests ahead of queued ones, then arrival."""
        return (self.spec.priority, self.status is not RequestStatus.PAUSED, self.spec.arrival_time)

    @property
    def keep_key(self) -> tuple[int, int]:
        """Running order: who keeps its blocks longest (the largest key is preempted first)."""
        return (self.spec.priority, self.admitted_seq or 0)


def token_events(events: list[tuple[DecodeRequest, int, str | None]], error: str | None = None,
                 logprobs: dict[int, list | None] | None = None) -> list[tuple[str, TokenEvent]]:
    """A step's events (request, output index, finish reason) -> (reply stream, TokenEvent) pairs
    for the outbox: each request's tokens from that index on (none for an error, which carries
    ``error``). ``logprobs``: id(request) -> its step's engine.logprobs entry (the event's one new token)."""
    queued = []
    for request, index, reason in events:
        new_tokens = request.output_token_ids[index:] if reason != "error" else []
        entry = logprobs.get(id(request)) if logprobs and new_tokens else None
        event = TokenEvent(request.request_id, index, new_tokens, reason, error if reason == "error" else None,
                           logprobs=None if entry is None else [entry])
        queued.append((request.spec.reply_to, event))
    return queued
