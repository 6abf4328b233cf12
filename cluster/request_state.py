"""Request statuses and the finish rule, shared by both worker pools.

A request moves through these statuses (each worker documents which moves it
makes): QUEUED -> PREALLOC -> PREFILLING -> TRANSFERRING -> DECODING
(<-> PAUSED) -> FINISHED | ABORTED | FAILED.
"""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
    QUEUED = "queued"  # received, holds no blocks
    PREALLOC = "prealloc"  # decode blocks reserved, prefill job not yet taken
    PREFILLING = "prefilling"  # a prefill worker is computing the prompt
    TRANSFERRING = "transferring"  # KV on its way into the decode blocks
    DECODING = "decoding"  # in the running batch
    PAUSED = "paused"  # preempted, waiting to resume
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


def finish_reason(
    token_id: int,
    num_output_tokens: int,
    num_total_tokens: int,
    *,
    max_tokens: int,
    max_seq_len: int,
    stop_token_ids: list[int] | tuple[int, ...],
    eos_token_ids: list[int] | tuple[int, ...],
    ignore_eos: bool,
    min_tokens: int = 0,
) -> str | None:
    """Why a request ends after emitting ``token_id``, or None if it goes on.

    ``num_output_tokens`` and ``num_total_tokens`` already count ``token_id``. Within the first
    ``min_tokens`` tokens no stop or EOS token ends it (the sampler does not pick them there).
    """
    stops = num_output_tokens > min_tokens
    if stops and (token_id in stop_token_ids or (not ignore_eos and token_id in eos_token_ids)):
        return "stop"
    if num_output_tokens >= max_tokens or num_total_tokens >= max_seq_len:
        return "length"
    return None


def banned_token_ids(sampling, output_index: int, stop_token_ids, eos_token_ids, ignore_eos: bool) -> list[int]:
    """The tokens the sampler must not pick for output token ``output_index`` (0-based):
    while fewer than ``sampling.min_tokens`` are out, the stop tokens and (unless ignored) EOS."""
    if output_index >= sampling.min_tokens:
        return []
    return list(stop_token_ids) + ([] if ignore_eos else list(eos_token_ids))
