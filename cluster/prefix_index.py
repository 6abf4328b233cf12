"""Which prompt prefixes each worker has cached, kept in Redis for routing.

A prefill worker with prefix caching mirrors the chained block hashes its
cache holds (``tandem.engine.prefix_cache``) into the set ``tandem:prefix:<worker>``
(``PrefixIndex.sync``, once per loop step: only the hashes cached or evicted
since the last step travel). The set is bounded by the worker's KV pool and
expires with the worker: its TTL is the heartbeat TTL, refreshed every
heartbeat interval, and it is rebuilt whole if it expired meanwhile.

A worker with a host KV tier (``tandem.engine.host_kv_tier``) mirrors the tier's hashes the
same way into ``tandem:prefix-host:<worker>``.

A decode worker checks a prompt's chain hashes against every live prefill
worker's sets in one pipelined round trip (SMISMEMBER, ``longest_prefixes``)
and sends the job to the worker holding the longest prefix, then the least
loaded, then the next in turn (``choose_prefill_worker``). A prefix counts its
blocks on the device whole and the blocks it goes on with in host memory at
``HOST_BLOCK_WEIGHT`` each: they save the compute but cost a copy. The index is
a hint: a block evicted after the check is recomputed.

Workers that run both pools on one device (``--pools colocated``) publish their caches the same
way, and the gateway admits a request to the one holding the longest prefix of its prompt, then
by room (``tandem.gateway.router``, the same lookups on its asyncio pipeline).
"""

from __future__ import annotations

import time

import redis

from tandem.cluster import keys
from tandem.cluster.messages import WorkerInfo


HOST_BLOCK_WEIGHT = 0.5  # a block in a worker's host tier, against one on its device


class PrefixIndex:
    """Prefill side: keeps ``tandem:prefix:<worker_id>`` equal to a ``PrefixCache``'s hashes (and
    ``tandem:prefix-host:<worker_id>`` to its host tier's, with one)."""

    def __init__(self, client: redis.Redis, worker_id: str, cache, ttl_s: float, refresh_s: float, host_tier=None):
        self._client = client
        # each source has take_changes(), cached_hashes() and num_cached
        self._sets = [(keys.prefix_index(worker_id), cache)]
        if host_tier is not None:
            self._sets.append((keys.prefix_host_index(worker_id), host_tier))
        self._ttl_ms = int(ttl_s * 1000)
        self._refresh_s = refresh_s
        self._refresh_at = 0.0

    def sync(self) -> None:
        changes = [source.take_changes() for _, source in self._sets]
        now = time.monotonic()
        if not any(added or removed for added, removed in changes) and now < self._refresh_at:
            return
        pipe = self._client.pipeline(transaction=False)
        exists_at = []  # where each set's EXISTS reply lands in the pipeline's results
        for (key, _), (added, removed) in zip(self._sets, changes):
            exists_at.append(len(pipe))
            pipe.exists(key)
            if removed:
                pipe.srem(key, *removed)
            if added:
                pipe.sadd(key, *added)
            pipe.pexpire(key, self._ttl_ms)
        results = pipe.execute()
        for (key, source), (added, _), at in zip(self._sets, changes, exists_at):
            if not results[at] and source.num_cached > len(added):
                # the set expired (the loop stalled past the TTL): write it whole again
                pipe.sadd(key, *source.cached_hashes())
                pipe.pexpire(key, self._ttl_ms)
        pipe.execute()
        self._refresh_at = now + self._refresh_s

    def delete(self) -> None:
        try:
            self._client.delete(*(key for key, _ in self._sets))
        except redis.RedisError:
            pass


def longest_prefixes(client: redis.Redis, worker_ids: list[str], hashes: list[bytes]) -> dict[str, float]:
    """worker id -> how many leading ``hashes`` it holds (one round trip): its device prefix cache's
    leading run, plus ``HOST_BLOCK_WEIGHT`` for each block the prefix goes on with in its host tier."""
    if not hashes or not worker_ids:
        return {worker_id: 0 for worker_id in worker_ids}
    pipe = client.pipeline(transaction=False)
    queue_prefix_queries(pipe, worker_ids, hashes)
    return prefix_scores(worker_ids, pipe.execute())


def queue_prefix_queries(pipe, worker_ids: list[str], hashes: list[bytes]) -> None:
    """Queue on ``pipe`` (redis-py's, sync or asyncio) the lookups ``prefix_scores`` reads."""
    for worker_id in worker_ids:
        pipe.smismember(keys.prefix_index(worker_id), hashes)
        pipe.smismember(keys.prefix_host_index(worker_id), hashes)


def prefix_scores(worker_ids: list[str], results: list) -> dict[str, float]:
    """The replies of ``queue_prefix_queries`` -> worker id -> its prefix's length in blocks (device
    blocks whole, host-tier blocks at ``HOST_BLOCK_WEIGHT``)."""
    matches = {}
    for i, worker_id in enumerate(worker_ids):
        device, host = results[2 * i], results[2 * i + 1]
        count = 0
        while count < len(device) and device[count]:
            count += 1
        more = count
        while more < len(host) and (host[more] or device[more]):
            more += 1
        matches[worker_id] = count + HOST_BLOCK_WEIGHT * (more - count)
    return matches


def choose_prefill_worker(workers: list[WorkerInfo], cached_blocks: dict[str, int], turn: int) -> WorkerInfo:
    """Longest cached prefix, then least loaded, then round robin (by ``turn``) over the worker ids."""
    ordered = sorted(workers, key=lambda w: w.worker_id)
    ranked = [
        (-cached_blocks.get(w.worker_id, 0), w.num_waiting + w.num_running, (index - turn) % len(ordered), w)
        for index, w in enumerate(ordered)
    ]
    return min(ranked, key=lambda r: r[:3])[3]
