"""End to end on the CPU: models split over two ranks (two processes, gloo), through real
redis, gateway and workers.

- A worker of both pools (``--tensor-parallel-size 2``): eight streams at once, prompts longer
  than the step budget (prompt chunks share steps with decode rows), equal HF transformers'
  greedy output token for token. A follower rank killed: the worker's next step fails its
  collective and the worker exits (its supervisor restarts it whole), not a wrong answer.
- Separate pools of different degrees (``--prefill-tp``, ``--decode-tp``: 1 and 2, 2 and 1,
  2 and 2): the handoff moves each rank's KV heads to the ranks that hold them; every stream
  equals HF greedy, and the decode worker holds no block afterwards.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.cluster import LocalCluster
from tests.e2e.serve_cluster import Stream

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


@pytest.fixture
def split_cluster(tiny_llama, tmp_path):
    c = LocalCluster(tiny_llama, str(tmp_path), layout="colocated", tokens_per_block=4, max_num_tokens=16,
                     max_seq_len=256, max_input_len=200, tensor_parallel_size=2, cpu_threads=1)
    c.start()
    yield c
    c.stop()


def _follower_pids(pid: int) -> list[int]:
    """The worker's tensor-parallel ranks: its spawned children (not multiprocessing's resource tracker)."""
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    ranks = []
    for child in pids:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(child)
    return ranks


def _all_equal_hf(cluster, prompts: list[list[int]], hf_greedy) -> None:
    """Stream every prompt at once; each answer equals HF greedy."""
    streams = []
    for prompt in prompts:
        stream = Stream(cluster.base_url, cluster.settings.model_name, "", MAX_TOKENS)
        stream.body["prompt"] = prompt
        stream.start()
        streams.append(stream)
    for stream, prompt in zip(streams, prompts):
        stream.join(120)
        assert stream.status == 200 and stream.done and stream.error is None, (stream.error, cluster.logs())
        assert stream.token_ids == hf_greedy(prompt, MAX_TOKENS)


def test_two_ranks_answer_as_hf(split_cluster, hf_greedy):
    cluster = split_cluster
    prompts = [[3 + (5 * i + 3 * j) % 400 for j in range(20 + 9 * i)] for i in range(8)]
    _all_equal_hf(cluster, prompts, hf_greedy)
    info = cluster.wait_blocks_free("decode", "decode-0")
    assert info.num_mixed_steps > 0
    assert len(_follower_pids(cluster.procs["decode-0"].pid)) == 1


def test_a_dead_rank_ends_its_worker_and_the_stream_goes_on_on_the_other(tiny_llama, tmp_path, hf_greedy):
    """Two colocated workers of two ranks each; a follower rank of the worker streaming a request
    is killed: that worker's next step fails its collective and the worker exits, and the stream
    continues on the other worker, equal to HF greedy."""
    from tandem.launcher import wait_healthy

    max_tokens = 200
    prompt = [3 + (11 * j) % 400 for j in range(30)]
    cluster = LocalCluster(tiny_llama, str(tmp_path), "colocated", tokens_per_block=4, max_num_tokens=64,
                           max_seq_len=512, tensor_parallel_size=2, cpu_threads=1)
    try:
        for worker_id in ("decode-0", "decode-1"):
            cluster.start_service("colocated", worker_id)
        cluster.start_service("gateway")
        assert wait_healthy(f"{cluster.base_url}/health", list(cluster.procs.values()), 180.0), cluster.logs()
        client = Stream(cluster.base_url, cluster.settings.model_name, "", max_tokens, ignore_eos=True)
        client.body["prompt"] = prompt
        client.start()
        deadline = time.monotonic() + 60
        victim = None
        while victim is None and time.monotonic() < deadline:
            victim = cluster.busy_worker("decode", ("decode-0", "decode-1")) if len(client.arrivals) > 5 else None
            time.sleep(0.02)
        assert victim is not None, f"the request never ran: {client.error}\n{cluster.logs()}"
        os.kill(_follower_pids(cluster.procs[victim].pid)[0], signal.SIGKILL)
        tokens_at_kill = len(client.token_ids)
        client.join(120)
        assert client.status == 200 and client.done and client.error is None, (client.error, cluster.logs())
        assert 0 < tokens_at_kill < max_tokens, "killed after the request had finished: the test proves nothing"
        assert client.token_ids == hf_greedy(prompt, max_tokens)
        assert cluster.procs[victim].wait(30) not in (None, 0)  # the worker ended with its rank
        assert "TPGroupLost" in cluster.logs()
    finally:
        cluster.stop()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (2, 2)])
def test_the_handoff_between_pools_of_different_degrees_equals_hf(tiny_llama, tmp_path, hf_greedy, prefill_tp,
                                                                   decode_tp):
    cluster = LocalCluster(tiny_llama, str(tmp_path), tokens_per_block=4, max_num_tokens=16, max_seq_len=256,
                           max_input_len=200, prefill_tp=prefill_tp, decode_tp=decode_tp, cpu_threads=1)
    cluster.start()
    try:
        prompts = [[3 + (7 * i + 5 * j) % 400 for j in range(14 + 11 * i)] for i in range(6)]
        _all_equal_hf(cluster, prompts, hf_greedy)
        cluster.wait_blocks_free("decode", "decode-0")
        for worker in ("prefill-0", "decode-0"):
            assert len(_follower_pids(cluster.procs[worker].pid)) == {"prefill-0": prefill_tp,
                                                                      "decode-0": decode_tp}[worker] - 1
    finally:
        cluster.stop()


def test_tandem_serve_restarts_a_split_worker_whose_rank_died_and_loses_no_stream(tiny_llama, tmp_path, hf_greedy):
    """``tandem serve --tensor-parallel-size 2``: a follower rank killed while 6 streams decode; its
    worker ends, the supervisor starts it again whole (two new ranks), and every stream goes on on
    its new run to HF's answer. Afterwards no pool file and no process is left."""
    from transformers import AutoTokenizer

    from tests.e2e.serve_cluster import Serve, children, running, start_streams, wait_tokens

    prompts = [f"Stream {i} of the split model begins here with a few words" for i in range(6)]
    serve = Serve(tiny_llama, tmp_path, "--tensor-parallel-size", "2", pools="colocated")
    try:
        streams = start_streams(serve, prompts, 60)
        wait_tokens(streams, 6)
        (follower,) = _follower_pids(serve.pids["colocated-0"])
        os.kill(follower, signal.SIGKILL)
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        for stream, prompt in zip(streams, prompts):
            stream.join(180)
            assert stream.status == 200 and stream.done and stream.error is None, (stream.error, serve.log())
            assert stream.token_ids == hf_greedy(tokenizer(prompt).input_ids, 60)
        assert "colocated-0 restarted" in serve.log()
        assert not running(serve.pids["colocated-0"])
        serve.wait_blocks_free()
        assert len(_follower_pids(children(serve.proc.pid)["colocated-0"])) == 1  # its new run's rank
        assert serve.stop() == 0
        assert serve.pool_files() == set()
    finally:
        if serve.proc.poll() is None:
            serve.stop()
