"""A decode step's ``logit_bias`` and penalties (``tandem.engine.logits_process``), with the
slots of token counts its penalized requests hold on the device (``tandem.engine.penalty_slots``).

``process`` is called between the step's forward and its sampling, ``count`` right after
sampling (the step's tokens are counted on the device: the next step may be launched
before they reach the host), ``release`` with the requests that left the batch for good
(``DecodeScheduler.pop_left_batch``). A step none of whose rows asks for any of it costs
one look at its rows' parameters; the device tensors describing a step (``Plan``) are made
again only when its batch or their slots change, so steady decoding copies nothing to the
device for it.

A request takes its slot, filled from its prompt and the output tokens known on the host,
on its first penalized step here (also after a pause or a failover); a slot whose count
differs from the output index the row samples (a row launched before its request's
previous token was known, then dropped) is filled again the same way, with the token
still on the device, if any, counted from the previous step's tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.decode.request import DecodeRequest
from tandem.engine.logits_process import Plan, apply, plan
from tandem.engine.penalty_slots import PenaltySlots
from tandem.engine.device_copy import to_device
from tandem.engine.step_tokens import TokenFeed


class Counting(NamedTuple):
    """Which of a step's sampled tokens go into which slots."""

    keys: list[str]  # the penalized rows' request ids
    index: torch.Tensor  # [2, R] int64 on the device: their rows in the step, their slots


class DecodePenalties:
    def __init__(self):
        self.slots: PenaltySlots | None = None  # made for the first penalized request
        self._plan: Plan | None = None
        self._plan_key: tuple | None = None  # the batch (ids, parameters) and slots it was made for

    def process(self, logits: torch.Tensor, batch: list[DecodeRequest], indices: list[int],
                feed: TokenFeed | None) -> tuple[torch.Tensor, Counting | None]:
        """-> (the logits to sample from, what ``count`` needs; None: nothing to count).
        ``indices``: the output index each row samples; ``feed``: the step's token feed."""
        params = [r.spec.sampling for r in batch]
        if not any(p.processed for p in params):
            return logits, None
        rows = [i for i, p in enumerate(params) if p.penalized]
        keys = [batch[i].request_id for i in rows]
        slots = {}
        if rows:
            if self.slots is None:
                self.slots = PenaltySlots(logits.shape[-1], logits.device)
            self._refill([i for i, key in zip(rows, keys) if self.slots.counted(key) != indices[i]], batch, feed)
            slots = {i: self.slots.slot(key) for i, key in zip(rows, keys)}
        key = (tuple((r.request_id, id(r.spec.sampling)) for r in batch), tuple(slots.values()))
        if key != self._plan_key:
            self._plan, self._plan_key = plan(params, logits.shape[-1], logits.device, slots), key
        if not rows:
            return apply(logits, self._plan), None
        out = apply(logits, self._plan, self.slots.counts, self.slots.prompt)
        return out, Counting(keys, self._plan.penalties[0])

    def count(self, counting: Counting | None, sampled: torch.Tensor) -> None:
        """Count the step's sampled tokens [B] (on the device) into the penalized rows' slots."""
        if counting is not None:
            self.slots.count(counting.keys, counting.index[1], sampled[counting.index[0]])

    def release(self, request_ids) -> None:
        if self.slots is not None:
            self.slots.release(request_ids)

    def _refill(self, rows: list[int], batch: list[DecodeRequest], feed: TokenFeed | None) -> None:
        """Fill the slots of these rows' requests from their prompt and host-known output, then
        count the token each still has on the device (fed to this step from the previous one)."""
        if not rows:
            return
        requests = [batch[i] for i in rows]
        slots = self.slots.reset([r.request_id for r in requests], [r.spec.prompt_token_ids for r in requests],
                                 [r.output_token_ids for r in requests])
        pending = [(i, r, s) for i, r, s in zip(rows, requests, slots) if r.num_pending]
        if pending:
            index = to_device(torch.tensor([[feed.rows[i] for i, _, _ in pending], [s for _, _, s in pending]],
                                            dtype=torch.int64), self.slots.device)
            self.slots.count([r.request_id for _, r, _ in pending], index[1], feed.tokens[index[0]])
