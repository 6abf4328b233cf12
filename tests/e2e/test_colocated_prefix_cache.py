"""End to end on the CPU: prefix caching in the worker that runs both pools on one device
(``--pools colocated --enable-prefix-caching``), its steps run ahead of the host.

Eight streams share a long system prefix and differ after it; sent in two waves, the second finds
the prefix cached and computes only its own tail. Each conversation then goes on with its whole
history (prompt, answer, a new question) and finds its answer's blocks cached too. The pool is
small, so cached blocks are evicted for new ones on the way. Every answer equals HF greedy, and
once idle the worker holds nothing (cached blocks nobody holds count as free).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tandem.cluster import keys
from tests.e2e.cluster import LocalCluster

pytestmark = pytest.mark.slow

BLOCK, MAX_TOKENS = 4, 8
PREFIX = [3 + (5 * j) % 400 for j in range(64)]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    # 640 tokens of pool: four 100-token turns in flight, a few conversations' worth cached
    c = LocalCluster(tiny_llama, str(tmp_path_factory.mktemp("logs-colocated-prefix")), layout="colocated",
                     tokens_per_block=BLOCK, max_num_tokens=32, max_seq_len=256, max_input_len=200,
                     enable_prefix_caching=True, max_tokens_in_paged_kv_cache=640, decode_run_ahead="on")
    c.start()
    yield c
    c.stop()


def _complete(http: httpx.Client, cluster, prompt: list[int]) -> tuple[list[int], int]:
    resp = http.post("/v1/completions", json={"model": cluster.settings.model_name, "prompt": prompt,
                                              "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["choices"][0]["token_ids"], out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_a_shared_prefix_and_each_conversation_s_history_are_computed_once(cluster, hf_greedy):
    prompts = [PREFIX + [400 + i, 7, 11 + i] for i in range(8)]
    with httpx.Client(base_url=cluster.base_url, timeout=120) as http, ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda p: _complete(http, cluster, p), prompts[:1]))
        rest = list(pool.map(lambda p: _complete(http, cluster, p), prompts[1:]))
        for prompt, (answer, _) in zip(prompts, first + rest):
            assert answer == hf_greedy(prompt, MAX_TOKENS)
        # every later stream found the shared prefix (16 blocks) in the cache
        assert all(cached >= len(PREFIX) for _, cached in rest), [c for _, c in rest]

        # the next turn: the conversation so far, then a question; sent one at a time, each finds
        # its own history (the prompt and the answer's full blocks) cached
        for prompt, (answer, _) in list(zip(prompts, first + rest))[:4]:
            history = prompt + [a if a < 500 else 5 for a in answer]  # the tokenizer's vocabulary is smaller
            follow_up = history + [21, 22, 23]
            next_answer, cached = _complete(http, cluster, follow_up)
            assert next_answer == hf_greedy(follow_up, MAX_TOKENS)
            # KV was written for every position of the history but its last token
            expected = (len(history) - 1) // BLOCK * BLOCK if max(answer) < 500 else len(prompt) // BLOCK * BLOCK
            assert cached >= expected, (cached, len(history), answer)
    info = cluster.wait_blocks_free("decode", "decode-0")
    assert info.prefix_device_hits > 0, info
    # the gateway reads the worker's record into its metrics as it refreshes them
    want, deadline = 'tandem_kv_cache_hit_blocks_total{tier="device",worker="decode-0"}', time.monotonic() + 15
    while want not in (metrics := httpx.get(f"{cluster.base_url}/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert want in metrics


def test_bench_multi_turn_sends_each_conversation_so_far_and_reports_the_reuse(cluster, tmp_path):
    from tandem.cli import main as cli

    out = tmp_path / "multi_turn.json"
    assert cli(["bench", "multi-turn", "--base-url", cluster.base_url, "--num-conversations", "6", "--num-turns", "3",
                "--first-len", "40", "--question-len", "6", "--answer-len", "8", "--max-concurrency", "2",
                "--prompt-vocab-size", "500", "--result-json", str(out)]) == 0
    import json

    metrics = json.loads(out.read_text())["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (18, 0), metrics
    assert metrics["output_tokens"] == 18 * 8
    # turn t's prompt: 40 + t x (8 + 6) tokens, six conversations each
    assert metrics["prompt_tokens"] == 6 * (40 + 54 + 68)
    # the pool keeps every conversation here: a later turn finds all but its last partial block and question
    assert metrics["cached_fraction_later_turns"] > 0.6, metrics
    assert metrics["ttft_ms"]["p50"] > 0 and metrics["output_throughput"] > 0


def _hold_room(cluster, worker_id: str, hold: bool) -> None:
    """An admission entry that takes (or gives back) the worker's whole pool: admissions go elsewhere."""
    info = cluster.worker("decode", worker_id)
    charge = info.num_total_blocks * info.block_size
    if hold:
        cluster.redis.hset(keys.admitted(worker_id), "test-hold", charge)
        cluster.redis.incrby(keys.reserved_tokens(worker_id), charge)
    else:
        cluster.redis.hdel(keys.admitted(worker_id), "test-hold")
        cluster.redis.decrby(keys.reserved_tokens(worker_id), charge)


def test_each_conversation_s_turns_go_back_to_the_worker_holding_its_history(tiny_llama, tmp_path, hf_greedy):
    """Two colocated workers with prefix caching, three conversations started on each (the other's
    room held meanwhile): the gateway admits each later turn, all sent at once, to the worker
    holding the conversation so far (the longest cached prefix), so every later turn finds its
    history cached. By room alone they would land on either worker."""
    from tandem.launcher import wait_healthy

    c = LocalCluster(tiny_llama, str(tmp_path), layout="colocated", tokens_per_block=BLOCK, max_num_tokens=32,
                     max_seq_len=256, max_input_len=200, enable_prefix_caching=True)
    try:
        for worker_id in ("decode-0", "decode-1"):
            c.start_service("colocated", worker_id)
        c.start_service("gateway")
        assert wait_healthy(f"{c.base_url}/health", list(c.procs.values()), 180.0), c.logs()
        deadline = time.monotonic() + 60  # the gateway is healthy with one worker: both must be there
        while not all(c.worker("decode", w) for w in ("decode-0", "decode-1")):
            assert time.monotonic() < deadline, c.logs()
            time.sleep(0.1)
        histories = [[5 + (13 * i + 7 * j) % 400 for j in range(30 + 3 * i)] for i in range(6)]
        with httpx.Client(base_url=c.base_url, timeout=120) as http, ThreadPoolExecutor(6) as pool:
            for turn in range(3):
                prompts = [h + [30 + turn, 31 + turn] for h in histories]
                if turn == 0:  # conversations 0-2 start on decode-0, 3-5 on decode-1
                    results = []
                    for held, start in (("decode-1", 0), ("decode-0", 3)):
                        _hold_room(c, held, True)
                        results += list(pool.map(lambda p: _complete(http, c, p), prompts[start : start + 3]))
                        _hold_room(c, held, False)
                else:
                    results = list(pool.map(lambda p: _complete(http, c, p), prompts))
                for i, (prompt, (answer, cached)) in enumerate(zip(prompts, results)):
                    assert answer == hf_greedy(prompt, MAX_TOKENS)
                    if turn:  # the previous turn's prompt and answer, all but its last partial block
                        assert cached >= (len(histories[i]) - 1) // BLOCK * BLOCK - BLOCK, (turn, i, cached)
                    histories[i] = prompt + [a if a < 500 else 5 for a in answer]
        hits = [c.worker("decode", w).prefix_device_hits for w in ("decode-0", "decode-1")]
        assert all(n > 0 for n in hits), hits  # both workers served conversations
    finally:
        c.stop()
