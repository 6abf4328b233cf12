"""A host-memory tier under a worker's KV pool: prefix blocks evicted from the device live on here.

The prefix cache (``engine.prefix_cache``) names a full prompt block by the hash chained over
its prefix. When it evicts a cached block from the device pool, the block's K/V (every layer,
K and V: ``block_bytes``) is copied here under the same hash; a later prompt whose prefix
continues past the device-cached blocks into host-resident ones gets those copied back into
fresh device blocks instead of computing them again. The tier is an LRU of its own, in slots of
one block each: storing into a full tier drops its least recently used block.

On a GPU the tier is one pinned buffer. A store gathers the evicted blocks into one contiguous
block-major device buffer on the compute stream, in one kernel (``ops.gather_blocks`` into the
buffer's [layers, 2, n, ...] view; the blocks may be reallocated by the next step, which then
runs after the gather), and the store stream moves it to the host asynchronously, one transfer per
run of consecutive slots; the compute stream never waits for it. A load starts the transfers of
its runs of slots first, on a stream of their own (into a staging buffer of that stream, so they
need not wait for the steps in flight), checks the host bytes' checksums while they cross the
link, and has the compute stream wait for the transfers and scatter the blocks that passed into
the pool (``ops.scatter_blocks``, one kernel), so no step reads a block before its K/V arrived.
Stores and loads have a stream each (the link carries both directions at once); a store waits
for the loads before it, since a slot it rewrites may be one they read. The
bytes move as the widest integer words a row of the pool divides into. On the CPU the same
code runs with ordinary memory and plain copies.

Each stored block gets a checksum (the wrapping sum of its 64-bit words) once its copy has landed
on the host; a load checks it first, and a block that fails (or that the tier dropped meanwhile)
is not loaded: the prompt computes it and everything after it, as without the tier.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.device_copy import tensor_on
from tandem.kernels import ops


@dataclass
class HostTierStats:
    """Running totals, for the worker's statistics and registry record."""

    stored_blocks: int = 0  # blocks copied to the host
    loaded_blocks: int = 0  # blocks copied back (prefix hits from the host)
    evicted_blocks: int = 0  # host blocks dropped for room
    bad_blocks: int = 0  # host blocks that failed their checksum when wanted (not loaded)
    bytes_out: int = 0  # device -> host
    bytes_in: int = 0  # host -> device
    # host seconds on the worker's loop: checking a load's bytes, waiting for a store a load needs,
    # checksumming stores that landed (host_tier_counters: the statistics lines' rise of each)
    check_s: float = 0.0
    wait_s: float = 0.0
    land_s: float = 0.0


class HostKVTier:
    def __init__(self, kv_pool, capacity_bytes: int):
        """``kv_pool``: the worker's ``KVCachePool``; ``capacity_bytes``: host memory for the tier."""
        # the pool's bytes as words: [num_layers, 2, num_blocks, block_size, num_kv_heads, row words]
        self.kv = _words(kv_pool.kv)
        shape = (self.kv.shape[0], 2) + tuple(self.kv.shape[3:])  # one block: every layer's K and V
        self.block_bytes = int(np.prod(shape)) * self.kv.element_size()
        self.capacity = int(capacity_bytes // self.block_bytes)
        if self.capacity < 1:
            raise ValueError(f"a host KV tier of {capacity_bytes} bytes holds no block of {self.block_bytes} bytes")
        self.device = self.kv.device
        self.cuda = self.device.type == "cuda"
        self.host = torch.empty((self.capacity,) + shape, dtype=self.kv.dtype, pin_memory=self.cuda)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._hash_in: dict[int, bytes] = {}  # slot -> hash
        self._free = list(range(self.capacity - 1, -1, -1))  # popped from the end: lowest slot first
        self._checksum: dict[int, int] = {}  # slot -> checksum of its bytes, once they landed
        self._in_flight: list[tuple[object, list[tuple[int, bytes]]]] = []  # (copy done, its (slot, hash)s)
        # stores and loads cross the link on streams of their own (it carries both directions at once)
        self._out_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._in_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._last_load = None  # the event after the latest load's transfers
        # hash -> held now? since take_changes() (the routing index); kept only once an index asked
        # (take_changes), and never for the blocks stored unindexed (a swapped-out request's)
        self._changes: dict[bytes, bool] = {}
        self._indexed = False
        self._unindexed: set[bytes] = set()
        self.stats = HostTierStats()

    # ---- lookups ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    @property
    def num_cached(self) -> int:
        """Prefix blocks held (not those stored unindexed)."""
        return len(self._slot_of) - len(self._unindexed)

    def cached_hashes(self) -> list[bytes]:
        """The prefix blocks held (not those stored unindexed)."""
        return [h for h in self._slot_of if h not in self._unindexed]

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes stored, hashes dropped) since the last call: for the worker's routing index
        (the first call starts the record: a worker with no index keeps none)."""
        self._indexed = True
        changes, self._changes = self._changes, {}
        return [h for h, held in changes.items() if held], [h for h, held in changes.items() if not held]

    def match(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` the tier holds (no side effects)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._slot_of:
                break
            count += 1
        return count

    # ---- device -> host ---------------------------------------------------------------
    def store(self, blocks: list[tuple[bytes, int]], indexed: bool = True) -> int:
        """Copy evicted device blocks (hash, block id) to the host, dropping least recently used host
        blocks for room; a hash already here is only touched. -> how many were copied.
        ``indexed`` False: keys no routing index lists (a swapped-out request's blocks)."""
        todo = []
        for block_hash, block_id in blocks:
            if block_hash in self._slot_of:
                self._slot_of.move_to_end(block_hash)
            else:
                todo.append((block_hash, block_id))
        todo = todo[-self.capacity:]  # more than the tier holds: the last evicted (most recent) win
        if not todo:
            return 0
        slots = []
        for block_hash, _ in todo:
            if not self._free:
                self._drop(next(iter(self._slot_of)))
                self.stats.evicted_blocks += 1
            slot = self._free.pop()
            self._slot_of[block_hash] = slot
            self._hash_in[slot] = block_hash
            if not indexed:
                self._unindexed.add(block_hash)
            elif self._indexed:
                self._changes[block_hash] = True
            slots.append(slot)
        ids = tensor_on([block_id for _, block_id in todo], self.device)  # not waiting for the queued steps
        gathered = torch.empty((len(todo),) + tuple(self.host.shape[1:]), dtype=self.kv.dtype, device=self.device)
        ops.gather_blocks(self.kv, ids, out=gathered.movedim(0, 2))  # block-major: [n, layers, 2, block, ...]
        pairs = [(slot, block_hash) for slot, (block_hash, _) in zip(slots, todo)]
        if self.cuda:  # the gather ran on the compute stream; the copy to the host runs beside it
            self._out_stream.wait_stream(torch.cuda.current_stream(self.device))
            if self._last_load is not None:  # a slot dropped since is rewritten only once loads read it
                self._out_stream.wait_event(self._last_load)
            with torch.cuda.stream(self._out_stream):
                for start, end in _runs(slots):
                    self.host[slots[start] : slots[start] + end - start].copy_(gathered[start:end], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._out_stream)
            gathered.record_stream(self._out_stream)
            self._in_flight.append((done, pairs))
        else:
            self.host[torch.tensor(slots)] = gathered
            self._land(pairs)
        self.stats.stored_blocks += len(todo)
        self.stats.bytes_out += len(todo) * self.block_bytes
        return len(todo)

    def poll(self) -> None:
        """Seal the stores whose copies have landed (their slots get checksums)."""
        while self._in_flight and self._in_flight[0][0].query():
            self._land(self._in_flight.pop(0)[1])

    def _land(self, pairs: list[tuple[int, bytes]]) -> None:
        started = time.perf_counter()
        live = [slot for slot, block_hash in pairs if self._slot_of.get(block_hash) == slot]  # not dropped meanwhile
        for start, end in _runs(live):
            sums = _checksums(self.host[live[start] : live[start] + end - start])
            self._checksum.update(zip(live[start:end], sums))
        self.stats.land_s += time.perf_counter() - started

    # ---- host -> device ---------------------------------------------------------------
    def load(self, hashes: list[bytes], block_ids: list[int]) -> int:
        """Copy the host blocks of the leading ``hashes`` into device ``block_ids`` (one each), up to
        the first the tier no longer holds or whose bytes fail their checksum (that one is dropped).
        -> how many were loaded; the device blocks hold their K/V for every step launched after."""
        slots = []
        for block_hash in hashes[: len(block_ids)]:
            slot = self._slot_of.get(block_hash)
            if slot is None:
                break
            if slot not in self._checksum:  # its store is still in flight: wait for it
                self._wait_for(slot)
            slots.append(slot)
        shape = (len(slots),) + tuple(self.host.shape[1:])
        runs = _runs(slots)
        if self.cuda:  # every transfer starts at once, beside the steps in flight; the checks run meanwhile
            with torch.cuda.stream(self._in_stream):  # the staging buffer is the load stream's: no wait for them
                dest = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
                for start, end in runs:
                    dest[start:end].copy_(self.host[slots[start] : slots[start] + end - start], non_blocking=True)
                loaded = torch.cuda.Event()
                loaded.record(self._in_stream)
            self._last_load = loaded
        else:
            dest = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
        good = len(slots)  # slots[:good] passed their checks
        checking = time.perf_counter()
        for start, end in runs:
            sums = _checksums(self.host[slots[start] : slots[start] + end - start])
            bad = next((i for i, value in enumerate(sums) if value != self._checksum.get(slots[start + i])), None)
            if bad is not None:
                good = start + bad
                self._drop(self._hash_in[slots[good]])
                self.stats.bad_blocks += 1
                break
        self.stats.check_s += time.perf_counter() - checking
        for slot in slots[:good]:
            self._slot_of.move_to_end(self._hash_in[slot])
        if good:
            ids = tensor_on(block_ids[:good], self.device)
            if self.cuda:  # the scatter, on the compute stream, after the transfers
                torch.cuda.current_stream(self.device).wait_event(loaded)
                dest.record_stream(torch.cuda.current_stream(self.device))
            else:
                for start, end in runs:
                    dest[start:end] = self.host[slots[start] : slots[start] + end - start]
            ops.scatter_blocks(self.kv, ids, dest[:good].movedim(0, 2))
        self.stats.loaded_blocks += good
        self.stats.bytes_in += good * self.block_bytes
        return good

    def _wait_for(self, slot: int) -> None:
        while slot not in self._checksum and self._in_flight:
            done, pairs = self._in_flight.pop(0)
            waiting = time.perf_counter()
            done.synchronize()
            self.stats.wait_s += time.perf_counter() - waiting
            self._land(pairs)

    def _drop(self, block_hash: bytes) -> None:
        slot = self._slot_of.pop(block_hash)
        del self._hash_in[slot]
        if block_hash in self._unindexed:
            self._unindexed.discard(block_hash)
        elif self._indexed:
            self._changes[block_hash] = False
        self._checksum.pop(slot, None)
        self._free.append(slot)

    def drop(self, block_hash: bytes) -> bool:
        """Forget a block (its slot is reused); False if the tier does not hold it."""
        if block_hash not in self._slot_of:
            return False
        self._drop(block_hash)
        return True

    def slot(self, block_hash: bytes) -> int | None:
        """The host slot holding ``block_hash`` (its bytes: ``host[slot]``), if any."""
        return self._slot_of.get(block_hash)


def _runs(slots: list[int], longest: int | None = None) -> list[tuple[int, int]]:
    """(start, end) index ranges of ``slots`` that are consecutive slot numbers (at most ``longest``
    long): one copy each."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or (longest and i - start == longest):
            runs.append((start, i))
            start = i
    return runs


def _words(kv: torch.Tensor) -> torch.Tensor:
    """The pool's bytes as the widest integer words its rows (head_dim elements) divide into."""
    raw = kv.view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if raw.shape[-1] % dtype.itemsize == 0:
            return raw.view(dtype)
    return raw


def _checksums(blocks: torch.Tensor) -> list[int]:
    """A checksum of each host block's bytes: the wrapping sum of its 64-bit words (torch's CPU
    reduction, on the worker's threads); any single changed byte changes it."""
    raw = blocks.reshape(blocks.shape[0], -1).view(torch.uint8)
    if raw.shape[1] % 8 == 0:
        return raw.view(torch.int64).sum(dim=1).tolist()
    return raw.to(torch.int64).sum(dim=1).tolist()


def host_tier_counters(tier: HostKVTier | None) -> dict[str, int]:
    """Cumulative counts for a worker's statistics lines (``cluster.step_stats``: each line carries
    their rise over its interval): blocks stored and loaded, and the milliseconds of host work
    the tier took on the loop (``HostTierStats``' seconds). None without a tier."""
    if tier is None:
        return {}
    stats = tier.stats
    return {"tier_stored_blocks": stats.stored_blocks, "tier_loaded_blocks": stats.loaded_blocks,
            "tier_check_ms": int(stats.check_s * 1e3), "tier_wait_ms": int(stats.wait_s * 1e3),
            "tier_land_ms": int(stats.land_s * 1e3)}


def host_tier_info(tier: HostKVTier | None) -> dict:
    """A worker's record fields (``cluster.messages.WorkerInfo``) for its host tier: none without one."""
    if tier is None:
        return {}
    return {"host_tier_blocks": len(tier), "host_tier_capacity": tier.capacity,
            "host_tier_hits": tier.stats.loaded_blocks, "host_tier_evictions": tier.stats.evicted_blocks,
            "host_tier_bytes_out": tier.stats.bytes_out, "host_tier_bytes_in": tier.stats.bytes_in}
