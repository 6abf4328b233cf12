"""The block allocator of a worker whose requests share a prefix cache (plain Python, no torch).

A worker that runs both pools on one device (``tandem.colocated``) admits requests through the
decode side's capacity scheduler, which counts, allocates and frees blocks through a
``BlockAllocator``. With prefix caching on, a block no request holds may still keep a prompt's
KV for a later one (``engine.prefix_cache``): it is evictable, and for the scheduler it is as good
as free. ``CachingAllocator`` is the allocator the scheduler sees:

- ``num_free`` counts free and evictable blocks;
- an allocation short of free blocks evicts the least recently released cached ones first;
- ``free`` is the cache's ``release``: a cached block nobody holds stays cached, evictable.

Everything else (reference counts, blocks held while a step is on the device) is the underlying
allocator's, which the cache itself allocates from.
"""

from __future__ import annotations

from tandem.engine.block_allocator import BlockAllocator, blocks_for
from tandem.engine.prefix_cache import PrefixCache


class CachingAllocator:
    def __init__(self, allocator: BlockAllocator, cache: PrefixCache):
        if cache.allocator is not allocator:
            raise ValueError("the prefix cache must allocate from the same allocator")
        self.raw = allocator
        self.cache = cache
        self.block_size = allocator.block_size
        self.num_blocks = allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.cache.num_available

    @property
    def num_total(self) -> int:
        return self.raw.num_total

    @property
    def num_held(self) -> int:
        return self.raw.num_held

    def ref_count(self, block_id: int) -> int:
        return self.raw.ref_count(block_id)

    def can_allocate_total(self, num_tokens: int) -> bool:
        return self.raw.can_allocate_total(num_tokens)

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= self.num_free

    def allocate(self, num_tokens: int) -> list[int]:
        return self.allocate_blocks(blocks_for(num_tokens, self.block_size))

    def allocate_blocks(self, count: int) -> list[int]:
        return self.cache.allocate(count)

    def can_append(self, block_ids: list[int], new_num_tokens: int) -> bool:
        return blocks_for(new_num_tokens, self.block_size) - len(block_ids) <= self.num_free

    def append(self, block_ids: list[int], new_num_tokens: int) -> list[int]:
        added = self.allocate_blocks(max(blocks_for(new_num_tokens, self.block_size) - len(block_ids), 0))
        block_ids.extend(added)
        return added

    def share(self, block_ids: list[int]) -> None:
        self.raw.share(block_ids)

    def free(self, block_ids: list[int]) -> None:
        self.cache.release(block_ids)

    def step_launched(self, step: int) -> None:
        self.raw.step_launched(step)

    def step_done(self, step: int) -> None:
        self.raw.step_done(step)
