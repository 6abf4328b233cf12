"""Running decode steps back to back: a step's input tokens can come straight from
the previous step's sampled tokens on the device (``TokenFeed``), so step N+1 is
launched before step N's tokens reach the host; ``StepTokens`` brings them to
the host behind the step (one pinned copy and an event, no stream-wide sync).

The host then reads step N's tokens while the device runs step N+1: the GPU does
not wait for the host's per-step work (sampling bookkeeping, scheduling,
publishing), as in vLLM's async scheduling or SGLang's overlap scheduler.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenFeed(NamedTuple):
    """Where a step's input tokens come from, row by row."""

    tokens: torch.Tensor  # [B_prev] int64 on the model's device: the previous step's sampled tokens
    rows: list[int]  # one per row of this step: an index into ``tokens``, or -1 (the chunk's own token)

    def check(self, num_rows: int) -> None:
        if len(self.rows) != num_rows:
            raise ValueError(f"token feed has {len(self.rows)} rows for a step of {num_rows}")
        limit = self.tokens.shape[0]
        bad = [src for src in self.rows if not -1 <= src < limit]
        if bad:
            raise ValueError(f"token feed rows {bad[:4]} outside [-1, {limit})")


def gather_fed(input_ids: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: input_ids[i] = tokens[src[i]] where src[i] >= 0 (device ops only, no sync).

    input_ids, src: [B] int64 on one device; tokens: [B_prev >= 1] int64 on it too.
    """
    fed = tokens[src.clamp(min=0)]
    input_ids.copy_(torch.where(src >= 0, fed, input_ids))


class StepTokens:
    """One step's sampled tokens on their way to the host, with ``extra`` tensors of the step
    (its logprobs, when a row asked for them) copied alongside."""

    def __init__(self, tokens: torch.Tensor, extra: tuple[torch.Tensor, ...] | None = None):
        self.device_tokens = tokens  # [B] int64: what a ``TokenFeed`` of the next step reads
        self._ready = None
        self._host = _to_host(tokens)
        self._extra = None if extra is None else tuple(_to_host(t) for t in extra)
        if tokens.is_cuda:  # copied to pinned memory behind the step
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tokens.device))

    def wait(self) -> list[int]:
        """-> the tokens as Python ints (waits for this step only, not for steps launched after it)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

    def extra(self) -> tuple[torch.Tensor, ...] | None:
        """The ``extra`` tensors on the host (after ``wait``)."""
        return self._extra


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
