"""Prefix caching over the block allocator: plain Python, no torch.

A *full* block of a prompt is named by a hash chained over the prefix
(``tandem.cluster.block_hashes``): two prompts share block i's hash exactly when they share
every token up to the end of block i. The cache maps hashes to block ids.

Reference counts live in the allocator. The cache holds one reference on
every cached block; each job using the block holds another. A cached block
only the cache holds is *evictable*: it keeps its KV for a later prompt until
an allocation is short of free blocks, which evicts least recently released
first. Lifecycle of a block id here::

    allocate -> (computed, full) insert -> cached+held -> release -> evictable
    evictable -> acquire (a new prompt matched it) -> cached+held
    evictable -> evict (allocation short) -> free

``PrefixCache(allocator, enabled=False)`` is a pass-through (no matches, no
inserts), so the prefill scheduler has one code path either way.

A host tier (``host_tier``: ``engine.host_kv_tier.HostKVTier``, duck-typed here) keeps what the
device evicts: ``evict`` hands the evicted blocks' hashes and ids to the tier before their ids go
free, ``match_host`` counts how far a prefix continues there, ``load_host`` starts copying such
blocks into fresh device blocks, and ``landed`` caches them, once there, as if they had been
computed here.
"""

from __future__ import annotations

from collections import OrderedDict

from tandem.engine.block_allocator import BlockAllocator, OutOfBlocks

class PrefixCache:
    def __init__(self, allocator: BlockAllocator, *, enabled: bool = True, host_tier=None):
        self.allocator = allocator
        self.host_tier = host_tier if enabled else None
        self.block_size = allocator.block_size
        self.enabled = enabled
        self._block_of: dict[bytes, int] = {}  # hash -> cached block id
        self._hash_of: dict[int, bytes] = {}  # cached block id -> hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._changes: dict[bytes, bool] = {}  # hash -> cached now? since take_changes()

    # ---- counts -----------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.allocator.num_free + len(self._evictable)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def is_evictable(self, block_id: int) -> bool:
        """Cached and held by no job: it counts as available until a job acquires it."""
        return block_id in self._evictable

    # ---- lookups ----------------------------------------------------------------------
    def match(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (no side effects)."""
        block_ids = []
        if not self.enabled:
            return block_ids
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def match_host(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` the host tier holds (0 without one)."""
        return 0 if self.host_tier is None else self.host_tier.match(hashes)

    def load_host(self, hashes: list[bytes], block_ids: list[int]):
        """Start copying the host tier's blocks of the leading ``hashes`` into the held fresh
        ``block_ids`` -> the ``HostLoad`` in flight (``landed`` caches what it brought), or None
        when the tier holds none of them."""
        if self.host_tier is None or not hashes:
            return None
        load = self.host_tier.load(hashes, block_ids)
        return load if load.slots else None

    def landed(self, load) -> int:
        """Cache the blocks a host load brought (waiting for it if it is still in flight) -> how many
        (fewer than it asked for when the tier dropped one or one failed its checksum)."""
        count = load.wait()
        for block_hash, block_id in zip(load.hashes[:count], load.block_ids):
            self.insert(block_hash, block_id)
        return count

    def acquire(self, block_ids: list[int]) -> None:
        """Hold cached blocks for a job (from ``match``): they are no longer evictable."""
        for block_id in block_ids:
            self._evictable.pop(block_id, None)
        self.allocator.share(block_ids)

    # ---- allocation -------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_available

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks, evicting least recently used cached blocks when the free list is short."""
        if num_blocks > self.num_available:
            raise OutOfBlocks(f"need {num_blocks} blocks, {self.num_available} free or evictable")
        self.evict(num_blocks - self.allocator.num_free)
        return self.allocator.allocate_blocks(num_blocks)

    def evict(self, num_blocks: int) -> int:
        """Return up to ``num_blocks`` evictable blocks to the free list; how many were."""
        evicted = []
        while len(evicted) < num_blocks and self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of.pop(block_id)
            del self._block_of[block_hash]
            self._changes[block_hash] = False
            evicted.append((block_hash, block_id))
        if evicted and self.host_tier is not None:
            self.host_tier.store(evicted)  # before the ids go free: their next owner writes after the copy
        for _, block_id in evicted:
            self.allocator.free([block_id])
        return len(evicted)

    def clear(self) -> int:
        """Evict every cached block no job holds."""
        return self.evict(len(self._evictable))

    # ---- caching and release ----------------------------------------------------------
    def insert(self, block_hash: bytes, block_id: int) -> bool:
        """Cache a held block whose KV is now complete. False when disabled or the hash is cached already."""
        if not self.enabled or block_hash in self._block_of or block_id in self._hash_of:
            return False
        self.allocator.share([block_id])  # the cache's own reference
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._changes[block_hash] = True
        return True

    def release(self, block_ids: list[int]) -> None:
        """A job drops its blocks. Released last block first, so a prefix outlives its tails in the LRU."""
        for block_id in reversed(block_ids):
            self.allocator.free([block_id])
            if block_id in self._hash_of and self.allocator.ref_count(block_id) == 1:
                self._evictable[block_id] = None

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes cached, hashes evicted) since the last call: for a worker's index of its cache."""
        changes, self._changes = self._changes, {}
        return [h for h, cached in changes.items() if cached], [h for h, cached in changes.items() if not cached]

    def cached_hashes(self) -> list[bytes]:
        return list(self._block_of)
