"""Redis restarted without its data under 8 greedy streams (an external --redis-url): the
workers re-register and recreate their inbox groups at once, the gateway waits for them
instead of failing the streams over, and every stream equals HF greedy."""

from __future__ import annotations

import os
import time

import pytest
from transformers import AutoTokenizer

from tandem.redis_server import RedisServer
from tests.e2e.cluster import LocalCluster
from tests.e2e.serve_cluster import Stream, record_fault, wait_tokens

pytestmark = pytest.mark.slow

MAX_TOKENS = 80
PROMPTS = [f"Redis goes away under stream {i} and comes back with nothing in it" for i in range(8)]


def test_streams_survive_redis_restarted_empty(tiny_llama, tmp_path, hf_greedy):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cluster = LocalCluster(tiny_llama, str(tmp_path), tokens_per_block=4, max_num_tokens=32,
                           max_seq_len=256).start()
    try:
        model = os.path.basename(tiny_llama)
        streams = [Stream(cluster.base_url, model, p, MAX_TOKENS) for p in PROMPTS]
        for stream in streams:
            stream.start()
        wait_tokens(streams, 6)
        port = cluster.redis_server.port
        fault_at = time.monotonic()
        cluster.redis_server.stop()  # its data goes with it
        time.sleep(0.5)
        cluster.redis_server = RedisServer(port)  # back, empty
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        expected_all = [hf_greedy(tokenizer(s.body["prompt"]).input_ids, MAX_TOKENS) for s in streams]
        for stream in streams:
            stream.join(120)
        record_fault("Redis (--redis-url) restarted without its data", streams, expected_all, fault_at, 0)
        for stream, expected in zip(streams, expected_all):
            assert stream.status == 200 and stream.done and stream.error is None, (stream.error, len(stream.token_ids))
            assert stream.token_ids == expected
        assert all(proc.poll() is None for proc in cluster.procs.values()), "a process died"
        cluster.wait_blocks_free("decode", "decode-0")
        cluster.wait_blocks_free("prefill", "prefill-0")
    finally:
        cluster.stop()
