"""Which prompt prefixes each prefill worker has cached, kept in Redis for routing.

A prefill worker with prefix caching mirrors the chained block hashes its
cache holds (``tandem.engine.prefix_cache``) into the set ``tandem:prefix:<worker>``
(``PrefixIndex.sync``, once per loop step: only the hashes cached or evicted
since the last step travel). The set is bounded by the worker's KV pool and
expires with the worker: its TTL is the heartbeat TTL, refreshed every
heartbeat interval, and it is rebuilt whole if it expired meanwhile.

A decode worker checks a prompt's chain hashes against every live prefill
worker's set in one pipelined round trip (SMISMEMBER, ``longest_prefixes``)
and sends the job to the worker holding the longest prefix, then the least
loaded, then the next in turn (``choose_prefill_worker``). The index is a
hint: a block evicted after the check is recomputed.
"""

from __future__ import annotations

import time

import redis

from tandem.cluster import keys
from tandem.cluster.messages import WorkerInfo


class PrefixIndex:
    """Prefill side: keeps ``tandem:prefix:<worker_id>`` equal to a ``PrefixCache``'s hashes."""

    def __init__(self, client: redis.Redis, worker_id: str, cache, ttl_s: float, refresh_s: float):
        self._client = client
        self._key = keys.prefix_index(worker_id)
        self._cache = cache
        self._ttl_ms = int(ttl_s * 1000)
        self._refresh_s = refresh_s
        self._refresh_at = 0.0

    def sync(self) -> None:
        added, removed = self._cache.take_changes()
        now = time.monotonic()
        if not added and not removed and now < self._refresh_at:
            return
        pipe = self._client.pipeline(transaction=False)
        pipe.exists(self._key)
        if removed:
            pipe.srem(self._key, *removed)
        if added:
            pipe.sadd(self._key, *added)
        pipe.pexpire(self._key, self._ttl_ms)
        existed = pipe.execute()[0]
        if not existed and self._cache.num_cached > len(added):
            # the set expired (the loop stalled past the TTL): write it whole again
            pipe.sadd(self._key, *self._cache.cached_hashes())
            pipe.pexpire(self._key, self._ttl_ms)
            pipe.execute()
        self._refresh_at = now + self._refresh_s

    def delete(self) -> None:
        try:
            self._client.delete(self._key)
        except redis.RedisError:
            pass


def longest_prefixes(client: redis.Redis, worker_ids: list[str], hashes: list[bytes]) -> dict[str, int]:
    """worker id -> how many leading ``hashes`` its prefix cache holds (one round trip)."""
    if not hashes or not worker_ids:
        return {worker_id: 0 for worker_id in worker_ids}
    pipe = client.pipeline(transaction=False)
    for worker_id in worker_ids:
        pipe.smismember(keys.prefix_index(worker_id), hashes)
    matches = {}
    for worker_id, flags in zip(worker_ids, pipe.execute()):
        count = 0
        while count < len(flags) and flags[count]:
            count += 1
        matches[worker_id] = count
    return matches


def choose_prefill_worker(workers: list[WorkerInfo], cached_blocks: dict[str, int], turn: int) -> WorkerInfo:
    """Longest cached prefix, then least loaded, then round robin (by ``turn``) over the worker ids."""
    ordered = sorted(workers, key=lambda w: w.worker_id)
    ranked = [
        (-cached_blocks.get(w.worker_id, 0), w.num_waiting + w.num_running, (index - turn) % len(ordered), w)
        for index, w in enumerate(ordered)
    ]
    return min(ranked, key=lambda r: r[:3])[3]
