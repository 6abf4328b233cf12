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
runs after the gather), sums each block's words there (its checksum, kept on the device per
slot), and the store stream moves the buffer to the host asynchronously, one transfer per run
of consecutive slots; the compute stream never waits for it. A load (``HostLoad``) runs wholly on
a stream of its own: its transfers into a staging buffer of that stream start at once (after
the stores of its slots, should those still be in flight), then, behind the steps already
queued when it was issued (the last readers of its fresh blocks), it sums the blocks that
arrived, compares them with their stored checksums and scatters them into the pool
(``ops.scatter_blocks``, one kernel), and copies how many leading blocks passed to pinned host
memory. The host never waits for any of it: the worker polls ``HostLoad.done()`` and the request
joins the steps once its blocks are in (``decode.scheduler``'s LOADING requests), so the steps
of other requests go on meanwhile. Stores and loads have a stream each (the link carries both
directions at once); a store waits for the loads before it, since a slot it rewrites may be one
they read. The bytes move as the widest integer words a row of the pool divides into.

On the CPU the same code runs with ordinary memory: stores copy at once, and loads run on one
thread of the tier's (torch's copies and sums release the interpreter), so a load is in flight
there too while the worker's loop goes on.

A checksum is the wrapping sum of a block's 64-bit words, taken on the device from the bytes
stored and again from the bytes that came back; a block whose sums differ (or that the tier
dropped before the load was issued) ends the load there: the prompt computes it and everything
after it, as without the tier, and the tier drops it.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
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
    # host seconds on the worker's loop: issuing stores and loads, and waiting for a load
    # (HostLoad.wait: a swapped-out request's restore) (host_tier_counters)
    issue_s: float = 0.0
    wait_s: float = 0.0


class HostLoad:
    """Host blocks on their way into device blocks (``HostKVTier.load``). ``done()`` polls and
    ``wait()`` blocks; once done, ``count`` is how many of the leading ``hashes`` arrived intact
    in the leading ``block_ids`` (the rest of those blocks hold bytes the prompt recomputes)."""

    def __init__(self, tier: "HostKVTier | None", hashes: list[bytes], block_ids: list[int], slots: list[int],
                 pending=None, result=None):
        self.tier = tier
        self.hashes, self.block_ids, self.slots = hashes, block_ids, slots
        self._pending = pending  # a CUDA event or a Future (None: settled)
        self._result = result  # the pinned count tensor (CUDA) or None
        self._keep = ()  # buffers the load's stream uses until it is done
        self.count: int | None = None if pending is not None else 0

    def done(self) -> bool:
        if self.count is None and (self._pending.done() if isinstance(self._pending, Future)
                                   else self._pending.query()):
            self._settle()
        return self.count is not None

    def wait(self) -> int:
        """Block until the load is done -> ``count``."""
        if self.count is None:
            started = time.perf_counter()
            if isinstance(self._pending, Future):
                self._pending.exception()
            else:
                self._pending.synchronize()
            self.tier.stats.wait_s += time.perf_counter() - started
            self._settle()
        return self.count

    def _settle(self) -> None:
        if isinstance(self._pending, Future):
            count = self._pending.result()  # a load that raised raises here
        else:
            torch.cuda.current_stream(self.tier.device).wait_event(self._pending)  # steps read the blocks after it
            count = int(self._result[0])
        self._pending, self._result, self._keep = None, None, ()
        self.count = count
        self.tier._landed(self)


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
        self._expected = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)  # slot -> checksum
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._hash_in: dict[int, bytes] = {}  # slot -> hash
        self._free = list(range(self.capacity - 1, -1, -1))  # popped from the end: lowest slot first
        # stores whose transfers may still run, in order (one stream): (event after them, their slots),
        # and each such slot's event, for a load of it to wait on
        self._in_flight: deque[tuple[object, list[int]]] = deque()
        self._storing: dict[int, object] = {}
        # stores and loads cross the link on streams of their own (it carries both directions at once)
        self._out_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._in_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._loader = None if self.cuda else ThreadPoolExecutor(1, thread_name_prefix="host-kv-load")
        self._last_load = None  # the latest load's event (CUDA) or Future (CPU)
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
        started = time.perf_counter()
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
        # the checksums, on the compute stream: loads compare what arrives with them
        self._expected.index_copy_(0, tensor_on(slots, self.device), _checksums(gathered))
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
            self._in_flight.append((done, slots))
            self._storing.update((slot, done) for slot in slots)
        else:
            if self._last_load is not None:  # the loader thread may still read a slot dropped since
                self._last_load.exception()
            self.host[torch.tensor(slots)] = gathered
        self.stats.stored_blocks += len(todo)
        self.stats.bytes_out += len(todo) * self.block_bytes
        self.stats.issue_s += time.perf_counter() - started
        return len(todo)

    def poll(self) -> None:
        """Forget the stores whose transfers have run (a load of their slots then waits for nothing):
        the oldest first, as far as they have run."""
        while self._in_flight and self._in_flight[0][0].query():
            done, slots = self._in_flight.popleft()
            for slot in slots:
                if self._storing.get(slot) is done:  # not a later store's of the same slot
                    del self._storing[slot]

    # ---- host -> device ---------------------------------------------------------------
    def load(self, hashes: list[bytes], block_ids: list[int]) -> HostLoad:
        """Start copying the host blocks of the leading ``hashes`` the tier holds into device
        ``block_ids`` (one each). -> the ``HostLoad``: once done, its ``count`` leading blocks hold
        their K/V for every step launched after (up to the first whose bytes failed their checksum,
        which is dropped)."""
        slots = []
        for block_hash in hashes[: len(block_ids)]:
            slot = self._slot_of.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
            self._slot_of.move_to_end(block_hash)
        n = len(slots)
        if n == 0:
            return HostLoad(None, [], [], [])
        started = time.perf_counter()
        hashes, block_ids = list(hashes[:n]), list(block_ids[:n])
        slot_ids = tensor_on(slots, self.device)
        want = self._expected.index_select(0, slot_ids)  # after the stores that summed them
        ids = tensor_on(block_ids, self.device)
        runs = _runs(slots)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            queued = torch.cuda.Event()
            queued.record(compute)  # the steps queued now: the last readers of the fresh blocks
            result = torch.empty(1, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            stream = self._in_stream
            for event in {self._storing[slot] for slot in slots if slot in self._storing}:
                stream.wait_event(event)  # those host bytes are still on their way
            with torch.cuda.stream(stream):  # the staging buffer is the load stream's
                dest = torch.empty((n,) + tuple(self.host.shape[1:]), dtype=self.kv.dtype, device=self.device)
                for start, end in runs:
                    dest[start:end].copy_(self.host[slots[start] : slots[start] + end - start], non_blocking=True)
                stream.wait_event(queued)
                count = _intact(dest, want)
                ops.scatter_blocks(self.kv, ids, dest.movedim(0, 2))  # those past count: recomputed over
                result.copy_(count, non_blocking=True)
                loaded = torch.cuda.Event()
                loaded.record(stream)
            for tensor in (want, ids):
                tensor.record_stream(stream)
            self._last_load = loaded
            load = HostLoad(self, hashes, block_ids, slots, pending=loaded, result=result)
            load._keep = (dest,)
        else:
            def copy_in() -> int:
                dest = torch.cat([self.host[slots[start] : slots[start] + end - start] for start, end in runs])
                count = int(_intact(dest, want))
                ops.scatter_blocks(self.kv, ids, dest.movedim(0, 2))
                return count

            self._last_load = self._loader.submit(copy_in)
            load = HostLoad(self, hashes, block_ids, slots, pending=self._last_load)
        self.stats.issue_s += time.perf_counter() - started
        return load

    def _landed(self, load: HostLoad) -> None:
        """A load is done: count its blocks; the first that failed its checksum (if it is still the
        block the tier holds under its hash) is dropped."""
        count = load.count
        if count < len(load.slots):
            bad_hash, bad_slot = load.hashes[count], load.slots[count]
            if self._slot_of.get(bad_hash) == bad_slot:
                self._drop(bad_hash)
            self.stats.bad_blocks += 1
        self.stats.loaded_blocks += count
        self.stats.bytes_in += count * self.block_bytes

    def _drop(self, block_hash: bytes) -> None:
        slot = self._slot_of.pop(block_hash)
        del self._hash_in[slot]
        if block_hash in self._unindexed:
            self._unindexed.discard(block_hash)
        elif self._indexed:
            self._changes[block_hash] = False
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


def _checksums(blocks: torch.Tensor) -> torch.Tensor:
    """A checksum of each block of ``blocks`` [n, ...] (contiguous), on their device: the wrapping
    sum of its 64-bit words (int64 [n]); any single changed byte changes it."""
    raw = blocks.reshape(blocks.shape[0], -1).view(torch.uint8)
    if raw.shape[1] % 8 == 0:
        return raw.view(torch.int64).sum(dim=1)
    return raw.to(torch.int64).sum(dim=1)


def _intact(blocks: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many leading blocks of ``blocks`` have the checksums ``want`` (a 0-d int64 tensor on
    their device: no host sync)."""
    return torch.cumprod((_checksums(blocks) == want).to(torch.int64), dim=0).sum()


def host_tier_counters(tier: HostKVTier | None) -> dict[str, int]:
    """Cumulative counts for a worker's statistics lines (``cluster.step_stats``: each line carries
    their rise over its interval): blocks stored and loaded, and the milliseconds of host work
    the tier took on the loop, issuing copies and waiting for loads (``HostTierStats``' seconds).
    None without a tier."""
    if tier is None:
        return {}
    stats = tier.stats
    return {"tier_stored_blocks": stats.stored_blocks, "tier_loaded_blocks": stats.loaded_blocks,
            "tier_issue_ms": int(stats.issue_s * 1e3), "tier_wait_ms": int(stats.wait_s * 1e3)}


def host_tier_info(tier: HostKVTier | None) -> dict:
    """A worker's record fields (``cluster.messages.WorkerInfo``) for its host tier: none without one."""
    if tier is None:
        return {}
    return {"host_tier_blocks": len(tier), "host_tier_capacity": tier.capacity,
            "host_tier_hits": tier.stats.loaded_blocks, "host_tier_evictions": tier.stats.evicted_blocks,
            "host_tier_bytes_out": tier.stats.bytes_out, "host_tier_bytes_in": tier.stats.bytes_in}
