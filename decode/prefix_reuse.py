"""Prefix caching on the decode side's capacity scheduler (plain Python, no torch).

On one device running both pools (``tandem.colocated``), the decode side's scheduler reserves
the blocks a request's prompt is computed into. With a prefix cache (``engine.prefix_cache``)
that reservation starts from the cached blocks of the request's longest cached prefix, and the
request's prefill starts after them; with a host tier under the cache, the prefix goes on with
blocks copied in from host memory. When a request stops decoding (it ends, or is paused), the full
blocks of its output are cached too, so the next turn of a conversation, whose prompt is the
conversation so far, finds its answer's KV as well as its prompt's.

A request takes nothing from the cache when it scores its prompt (every position needs its
logits) or when its swapped-out KV (``decode.swap``) comes back instead. Hashes start from the
request's LoRA adapter's digest: two adapters never share KV. ``PrefixReuse(None, ...)`` does
nothing, so the scheduler has one code path either way.
"""

from __future__ import annotations

from tandem.decode.request import DecodeRequest
from tandem.cluster.block_hashes import block_hashes, num_reusable_blocks
from tandem.engine.prefix_cache import PrefixCache


class PrefixReuse:
    def __init__(self, cache: PrefixCache | None, swap, block_size: int):
        self.cache = cache if cache is not None and cache.enabled else None
        self.swap = swap
        self.block_size = block_size
        self.num_device_hit_blocks = 0  # blocks admissions took from the device cache (running total)

    def _applies(self, request: DecodeRequest) -> bool:
        if self.cache is None:
            return False
        if request.spec.sampling.prompt_logprobs is not None and not request.is_resuming:
            return False
        return self.swap is None or not self.swap.holds(request.request_id)

    def match(self, request: DecodeRequest) -> list[int]:
        """The cached blocks of its longest cached prefix (no side effects but its hashes, made once
        per admission's tokens)."""
        if not self._applies(request):
            return []
        tokens = request.prefill_token_ids
        if len(request.block_hashes) != len(tokens) // self.block_size:
            request.block_hashes = block_hashes(tokens, self.block_size, salt=request.spec.lora_digest)
        return self.cache.match(request.block_hashes[: num_reusable_blocks(len(tokens), self.block_size)])

    def num_held(self, block_ids: list[int]) -> int:
        """Of matched blocks, those some request holds (the others count as free until taken)."""
        return sum(not self.cache.is_evictable(block_id) for block_id in block_ids)

    def take(self, request: DecodeRequest) -> list[int]:
        """``match`` and hold the blocks for ``request``."""
        cached = self.match(request)
        if cached:
            self.cache.acquire(cached)
            self.num_device_hit_blocks += len(cached)
        return cached

    def load_host(self, request: DecodeRequest, num_cached: int, fresh: list[int]):
        """Start copying the blocks after its device prefix that the host tier holds into its first
        ``fresh`` blocks -> the ``HostLoad`` in flight (``landed`` caches them), or None."""
        if not self._applies(request) or self.cache.host_tier is None:
            return None
        end = num_reusable_blocks(len(request.prefill_token_ids), self.block_size)
        after = request.block_hashes[num_cached:end]
        return self.cache.load_host(after[: self.cache.match_host(after)], fresh)

    def landed(self, load) -> int:
        """A host load's blocks are in (waiting if not): cache them -> how many."""
        return self.cache.landed(load)

    def cache_output(self, request: DecodeRequest) -> None:
        """A request stops decoding: cache the full blocks whose KV it wrote (every position but its
        last token's, which no step has written; its prompt's blocks are cached already)."""
        if self.cache is None or not request.block_ids:
            return
        size = self.block_size
        num_full = (request.num_tokens - 1) // size
        # its admission hashed the tokens its prefill computed, a prefix of these: the chain goes on
        known = request.block_hashes[:num_full]
        tokens = (request.spec.prompt_token_ids + request.output_token_ids)[len(known) * size : num_full * size]
        rest = block_hashes(tokens, size, salt=request.spec.lora_digest, parent=known[-1] if known else None)
        for block_hash, block_id in zip(known + rest, request.block_ids):
            self.cache.insert(block_hash, block_id)
