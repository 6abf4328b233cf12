"""Sliding-window block release on the decode side (plain Python, no torch).

With an attention window of W tokens, the query at position p reads keys
p - W + 1 .. p only, so a block whose positions all lie below that is never
read again (the kernels skip it; the torch reference loads it and masks it
out). After each step such blocks leave the request's *live* blocks: the
released table entries stay in ``block_ids`` (the table is indexed by
position) but are neither read nor written again.

Released blocks first become the request's spares: when the table needs a
block for a new position it takes a spare, so a request never needs more than
``max_live_blocks`` blocks at once after its prompt. Spares no later position
needs go back to the allocator. Hence a request reserves
``min(prompt + max_tokens, max(prompt, max_live_blocks * block_size))`` tokens
of blocks (``reserved_tokens``) and, by recycling, never runs short
(GUARANTEED_NO_EVICT holds with less memory).
"""

from __future__ import annotations

from tandem.decode.request import DecodeRequest
from tandem.engine.block_allocator import BlockAllocator, blocks_for


class SlidingWindow:
    def __init__(self, allocator: BlockAllocator, window: int):
        if window <= 0:
            raise ValueError(f"attention window must be positive, got {window}")
        self.allocator = allocator
        self.window = window
        self.block_size = allocator.block_size
        # W consecutive positions touch at most this many blocks
        self.max_live_blocks = blocks_for(window - 1, self.block_size) + 1

    def reserved_tokens(self, num_prompt_tokens: int, num_total_tokens: int) -> int:
        """Tokens' worth of blocks the request holds at its peak."""
        return min(num_total_tokens, max(num_prompt_tokens, self.max_live_blocks * self.block_size))

    def advance(self, request: DecodeRequest, num_total_tokens: int) -> None:
        """After a step: release blocks out of the window, give the next position a block, trim spares.

        ``num_total_tokens``: the most tokens the request can reach (its reservation before the window).
        """
        block_size = self.block_size
        next_pos = request.num_tokens - 1  # the next step writes its K/V here and queries from here
        end = max(next_pos - self.window + 1, 0) // block_size
        if end > request.num_released_blocks:
            request.spare_block_ids.extend(request.block_ids[request.num_released_blocks : end])
            request.num_released_blocks = end
        while len(request.block_ids) <= next_pos // block_size and request.spare_block_ids:
            request.block_ids.append(request.spare_block_ids.pop(0))
        num_live = len(request.block_ids) - request.num_released_blocks
        num_future = blocks_for(num_total_tokens, block_size) - len(request.block_ids)
        keep = max(0, min(num_future, self.max_live_blocks - num_live))
        if len(request.spare_block_ids) > keep:
            surplus = request.spare_block_ids[keep:]
            del request.spare_block_ids[keep:]
            self.allocator.free(surplus)


def held_block_ids(request: DecodeRequest) -> list[int]:
    """Every block the request holds: its live table entries and its spares."""
    return request.block_ids[request.num_released_blocks :] + request.spare_block_ids
