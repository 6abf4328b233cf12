"""Swap instead of recompute: a preempted request's KV blocks wait in host memory.

Under MAX_UTILIZATION a decode worker pauses requests to free blocks (``DecodeScheduler.pause``).
Without a host tier the paused request's KV is recomputed when it resumes: a prefill of its
prompt and every output token but the last. With ``--kv-host-cache-gb`` the worker's own host
tier (``tandem.engine.host_kv_tier.HostKVTier``, keyed here by request id and block index) takes
the request's blocks as it pauses, and gives them back into the blocks reserved when it resumes:
it goes on decoding at once, and no prefill runs for it. Blocks the tier dropped meanwhile (it is
an LRU, shared by every paused request) or that fail their checksum make the resume fall back to
recompute, as without the tier.

Plain Python over the tier's ``store``, ``load`` and ``drop``; the copies are the tier's.
"""

from __future__ import annotations

from tandem.engine.block_allocator import blocks_for


class SwapSpace:
    def __init__(self, tier, block_size: int):
        self.tier = tier
        self.block_size = block_size
        self._saved: dict[str, int] = {}  # request id -> blocks saved
        self.num_swapped_out = 0  # requests whose blocks went to the host (running totals)
        self.num_swapped_in = 0  # requests resumed from the host, no prefill

    @staticmethod
    def _keys(request_id: str, n: int) -> list[bytes]:
        return [f"swap:{request_id}:{i}".encode() for i in range(n)]

    def save(self, request) -> None:
        """As ``request`` pauses: copy the blocks of its KV (every token but the last known one,
        which its next step feeds) to the host, before they go free."""
        n = blocks_for(request.num_tokens - 1, self.block_size)
        if n == 0 or n > len(request.block_ids) or n > self.tier.capacity:
            return
        self.discard(request.request_id)
        self.tier.store(list(zip(self._keys(request.request_id, n), request.block_ids[:n])), indexed=False)
        self._saved[request.request_id] = n
        self.num_swapped_out += 1

    def holds(self, request_id: str) -> bool:
        """Whether blocks of a paused request were saved (a resume will try them)."""
        return request_id in self._saved

    def restore(self, request) -> bool:
        """As a paused ``request`` is admitted again (its blocks reserved): copy its KV back -> True;
        False (nothing usable kept: it is recomputed) when the tier lost or rejected a block."""
        n = self._saved.pop(request.request_id, 0)
        if n == 0 or request.num_tokens - 1 > n * self.block_size or len(request.block_ids) < n:
            self._drop(request.request_id, n)
            return False
        keys = self._keys(request.request_id, n)
        loaded = self.tier.load(keys, request.block_ids[:n]).wait()  # it decodes on at once: its KV must be in
        self._drop(request.request_id, n)
        if loaded < n:
            return False
        self.num_swapped_in += 1
        return True

    def discard(self, request_id: str) -> None:
        """Forget a request's saved blocks (it ended, or saves again)."""
        self._drop(request_id, self._saved.pop(request_id, 0))

    def _drop(self, request_id: str, n: int) -> None:
        for key in self._keys(request_id, n):
            self.tier.drop(key)
