"""What the penalties of requests in decode look at, kept on the device: one slot per request.

A slot is a row of two [capacity, V] buffers on the model's device: ``counts`` (fp32, each
token's occurrences in the request's output) and ``prompt`` (bool, its prompt's tokens).
A request takes a slot when it first decodes with a penalty (``reset`` fills it from the
tokens known on the host: a resumed or failed-over request arrives with output tokens),
its step's sampled tokens are counted on the device right after sampling (``count``: the
next step is launched before they reach the host), and it gives the slot back when it
leaves the batch for good. The buffers are made for the first penalized request and
doubled when full, so a worker that never sees a penalty holds none.

The host keeps, per request, how many output tokens its slot has counted (``counted``):
a slot that counted a token the host later dropped (a row launched before its request's
previous token was known) is told apart and refilled instead of drifting.
"""

from __future__ import annotations

from typing import Hashable

import torch

from tandem.engine.device_copy import to_device

INITIAL_CAPACITY = 8


class PenaltySlots:
    def __init__(self, vocab: int, device: torch.device, capacity: int = INITIAL_CAPACITY):
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(capacity, vocab, dtype=torch.float32, device=device)
        self.prompt = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)
        self._slot: dict[Hashable, int] = {}
        self._counted: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest first
        self._ones = torch.ones(capacity, device=device)  # what ``count`` adds (a row at most per slot)

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    @property
    def num_used(self) -> int:
        return len(self._slot)

    def slot(self, key: Hashable) -> int | None:
        return self._slot.get(key)

    def counted(self, key: Hashable) -> int | None:
        """Output tokens the key's slot has counted (None: it holds no slot)."""
        return self._counted.get(key)

    def reset(self, keys: list[Hashable], prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
        """Give each key a slot (its own, or a free one) holding exactly its prompt and output
        tokens -> the slots. Device ops only."""
        for key in keys:
            if key not in self._slot:
                if not self._free:
                    self._grow()
                self._slot[key] = self._free.pop()
        slots = [self._slot[key] for key in keys]
        index = to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        self.counts.index_fill_(0, index, 0.0)
        self.prompt.index_fill_(0, index, False)
        marks = self._pairs(slots, prompts)
        self.prompt[marks[0], marks[1]] = True
        occurrences = self._pairs(slots, outputs)
        if occurrences.shape[1]:
            self.counts.index_put_((occurrences[0], occurrences[1]),
                                   torch.ones(occurrences.shape[1], device=self.device), accumulate=True)
        for key, output in zip(keys, outputs):
            self._counted[key] = len(output)
        return slots

    def count(self, keys: list[Hashable], slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """One more output token per key: ``tokens`` [R] int64 into ``slots`` [R] int64 (both on
        the device, the slots distinct), without waiting for them."""
        flat = slots * self.vocab + tokens  # one atomic add per row, no sort (index_put's accumulate sorts)
        self.counts.view(-1).index_add_(0, flat, self._ones[: tokens.shape[0]])
        for key in keys:
            self._counted[key] += 1

    def release(self, keys) -> None:
        """Give the keys' slots back (keys without one are ignored)."""
        for key in keys:
            slot = self._slot.pop(key, None)
            if slot is not None:
                del self._counted[key]
                self._free.append(slot)

    def _grow(self) -> None:
        """Double the capacity, keeping every slot's contents (in order on the device's stream)."""
        old = self.capacity
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self._ones = torch.ones(2 * old, device=self.device)
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def _pairs(self, slots: list[int], token_lists: list[list[int]]) -> torch.Tensor:
        """[2, N] int64 on the device: (slot, token) for every token of every slot's list."""
        host = torch.tensor([[s for s, ids in zip(slots, token_lists) for _ in ids],
                             [t for ids in token_lists for t in ids]], dtype=torch.int64)
        return to_device(host, self.device)
