"""Paged KV block allocator: plain Python, no torch.

Blocks are integers in ``[0, num_blocks)``. Each has a reference count so a
block can be shared (prefix caching): ``allocate`` hands out blocks with count
1, ``share`` adds a holder, ``free`` drops one and returns a block to the free
list when its count reaches zero. Predicates pair with actions:
``can_allocate`` / ``allocate``, ``can_append`` / ``append``.

Device steps run behind the host: a block freed while a launched step may still
read or write it must not be handed out yet (a prefill worker, another process,
would write it at once). ``step_launched(s)`` marks step ``s`` as on the device;
blocks freed from then on are held, not free, until ``step_done(s)`` (or a later
step's) says it finished. A pool that only its own process's stream reads and writes
(``hold_freed=False``: one device running both pools) holds nothing: the next owner's
writes are queued on that stream after the launched step's reads.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, hold_freed: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._held: list[tuple[int, list[int]]] = []  # (step, blocks freed while it was on the device)
        self._busy_step: int | None = None  # the newest step launched and not known done
        self.hold_freed = hold_freed  # hold blocks freed while a step is on the device (another process writes next)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate_total(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` could ever fit, with every block free."""
        return blocks_for(num_tokens, self.block_size) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks enough for ``num_tokens`` tokens."""
        return self.allocate_blocks(blocks_for(num_tokens, self.block_size))

    def allocate_blocks(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(count)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def can_append(self, block_ids: list[int], new_num_tokens: int) -> bool:
        extra = blocks_for(new_num_tokens, self.block_size) - len(block_ids)
        return extra <= len(self._free)

    def append(self, block_ids: list[int], new_num_tokens: int) -> list[int]:
        """Grow ``block_ids`` in place to hold ``new_num_tokens``; returns the new blocks."""
        extra = blocks_for(new_num_tokens, self.block_size) - len(block_ids)
        added = self.allocate_blocks(max(extra, 0))
        block_ids.extend(added)
        return added

    def share(self, block_ids: list[int]) -> None:
        """Add a holder to blocks already allocated (prefix sharing)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is not allocated")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        released = []
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                released.append(block_id)
        if self.hold_freed and self._busy_step is not None and released:
            self._held.append((self._busy_step, released))
        else:
            self._free.extend(released)

    # ---- device steps in flight -----------------------------------------------------
    def step_launched(self, step: int) -> None:
        """Step ``step`` (increasing ids) is on the device: blocks freed from now on wait for it."""
        self._busy_step = step

    def step_done(self, step: int) -> None:
        """Step ``step`` and every one before it finished: the blocks they held back are free."""
        keep = []
        for tag, block_ids in self._held:
            if tag <= step:
                self._free.extend(block_ids)
            else:
                keep.append((tag, block_ids))
        self._held = keep
        if self._busy_step is not None and self._busy_step <= step:
            self._busy_step = None

    @property
    def num_held(self) -> int:
        """Blocks freed but waiting for a step on the device."""
        return sum(len(block_ids) for _, block_ids in self._held)
