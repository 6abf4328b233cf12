"""Prefix-aware admission over workers that compute their own prompts (``--pools colocated``
with ``--enable-prefix-caching``): the worker holding the longest prefix of the prompt is tried
first, then by room; workers that hold none, or no prefix routing, keep the room order."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from tandem.cluster import keys
from tandem.cluster.block_hashes import block_hashes
from tandem.cluster.messages import WorkerInfo, encode
from tandem.gateway.router import PromptPrefix, Router

BLOCK = 4
PROMPT = list(range(10, 30))  # 20 tokens: 4 reusable blocks (the last token is always computed)


def _register(client, worker_id: str, free_blocks: int) -> None:
    info = WorkerInfo(worker_id=worker_id, role="decode", model="m", inbox="i", pid=1, host="h", started_at=1.0,
                      heartbeat_at=1.0, num_total_blocks=64, num_free_blocks=free_blocks, block_size=BLOCK,
                      max_seq_len=256, max_batch_size=8, computes_prompts=True)
    client.set(keys.worker("decode", worker_id), encode(info), px=60_000)


def _reserve(redis_url: str, prefix_routing: bool, prompt: PromptPrefix | None, request_id: str) -> str:
    async def main():
        client = aioredis.Redis.from_url(redis_url)
        try:
            router = Router(client, model="m", prefix_routing=prefix_routing)
            worker = await router.reserve(request_id, len(PROMPT), 8, prompt=prompt)
            return worker.worker_id
        finally:
            await client.aclose()

    taken = asyncio.run(main())
    client = redis.Redis.from_url(redis_url)  # each case from equal room: ties go by the records' free blocks
    client.delete(*(k for w in ("decode-0", "decode-1") for k in (keys.admitted(w), keys.reserved_tokens(w))))
    return taken


def test_the_worker_holding_the_prompt_s_prefix_is_tried_first(redis_url):
    client = redis.Redis.from_url(redis_url)
    _register(client, "decode-0", free_blocks=60)  # more room
    _register(client, "decode-1", free_blocks=20)
    hashes = block_hashes(PROMPT, BLOCK)
    client.sadd(keys.prefix_index("decode-1"), *hashes[:3])  # three of the four reusable blocks
    client.sadd(keys.prefix_index("decode-0"), hashes[0])
    assert _reserve(redis_url, True, PromptPrefix(PROMPT), "a") == "decode-1"
    assert _reserve(redis_url, False, PromptPrefix(PROMPT), "b") == "decode-0"  # no prefix routing: room
    assert _reserve(redis_url, True, None, "c") == "decode-0"
    other = [t + 100 for t in PROMPT]
    assert _reserve(redis_url, True, PromptPrefix(other), "d") == "decode-0"  # nobody holds it: room
    # another adapter's KV is its own: its chain starts from the adapter's digest
    assert _reserve(redis_url, True, PromptPrefix(PROMPT, salt="digest"), "e") == "decode-0"
    # a host-tier continuation counts half a block: 1 + 3 x 0.5 on decode-0 beats none on decode-1
    client.sadd(keys.prefix_host_index("decode-0"), *hashes[1:4])
    client.delete(keys.prefix_index("decode-1"))
    assert _reserve(redis_url, True, PromptPrefix(PROMPT), "f") == "decode-0"


def test_a_worker_without_room_is_passed_over_whatever_it_holds(redis_url):
    client = redis.Redis.from_url(redis_url)
    _register(client, "decode-0", free_blocks=60)
    _register(client, "decode-1", free_blocks=60)
    client.sadd(keys.prefix_index("decode-1"), *block_hashes(PROMPT, BLOCK))
    async def main():
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            router = Router(aclient, model="m", prefix_routing=True)
            # decode-1's admissions fill up (max_admitted falls back to max_batch_size 8): the 9th goes elsewhere
            return [(await router.reserve(f"r{i}", len(PROMPT), 8, prompt=PromptPrefix(PROMPT))).worker_id
                    for i in range(9)]
        finally:
            await aclient.aclose()

    assert asyncio.run(main()) == ["decode-1"] * 8 + ["decode-0"]
