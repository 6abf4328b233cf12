"""Tensor parallelism on the CPU: a model split over two ranks (two processes, gloo) gives the
logits of the whole model, step for step: prompt chunks, a mixed step, decode steps fed the
previous step's sampled tokens, and a step's hidden states (prompt logprobs); with Llama and
with Qwen2 (biased QKV) weights. A dead rank is fatal to its worker, never a wrong answer."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.config import ModelConfig
from tandem.engine.demo_model import make_tiny_checkpoint
from tandem.engine.loader import load_model
from tandem.engine.runner import ModelRunner
from tandem.engine.step_tokens import TokenFeed
from tandem.engine.tensor_parallel import TPGroup, check_tp_size, shard_config

BLOCK = 4
A = [3 + (7 * j) % 300 for j in range(13)]
B = [5 + (11 * j) % 300 for j in range(6)]


def script(runner: ModelRunner) -> list[torch.Tensor]:
    """One request's prompt in two chunks, another's beside its second chunk (a mixed step once A
    decodes), then greedy decode steps fed on the device; -> every step's logits."""
    blocks_a, blocks_b = list(range(0, 8)), list(range(8, 16))
    with pytest.raises(ValueError, match="KV slots"):  # a malformed step: refused on every rank; the group goes on
        runner.forward([SeqChunk([5], runner.max_position, blocks_a)])
    out = [runner.forward([SeqChunk(A[:8], 0, blocks_a)])]
    out.append(runner.forward([SeqChunk(A[8:], 8, blocks_a), SeqChunk(B, 0, blocks_b)]))
    tokens = out[-1].argmax(-1)
    seq = [len(A), len(B)]
    for _ in range(4):
        chunks = [SeqChunk([0], seq[0], blocks_a), SeqChunk([0], seq[1], blocks_b)]
        out.append(runner.forward(chunks, TokenFeed(tokens, [0, 1])))
        tokens = out[-1].argmax(-1)
        seq = [n + 1 for n in seq]
    c = [9, 10, 11, 12, 13]
    logits, hidden = runner.forward_hidden([SeqChunk([int(tokens[0])], seq[0], blocks_a), SeqChunk(c, 0, list(range(16, 24)))])
    return out + [logits, runner.compute_logits(hidden)]


def _rank(rank: int, path: str, init_method: str, result: str | None) -> None:
    torch.set_num_threads(1)
    group = TPGroup(rank, 2, init_method, torch.device("cpu"))
    model, config = load_model(path, dtype=torch.float32, tp_rank=rank, tp_size=2)
    runner = ModelRunner.from_model(model, config, num_blocks=32, block_size=BLOCK, tp=group)
    assert runner.kv_pool.num_kv_heads == 1  # its half of the KV heads
    if group.is_leader:
        torch.save(script(runner), result)
        group.stop()
    else:
        runner.follow()
    group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_split(path: str, result: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, path, init, result if r == 0 else None)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_ranks_give_the_whole_model_s_logits(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path / arch, arch)
    model, config = load_model(path, dtype=torch.float32)
    want = script(ModelRunner.from_model(model, config, num_blocks=32, block_size=BLOCK))
    _run_split(path, str(tmp_path / "split.pt"))
    got = torch.load(tmp_path / "split.pt")
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def _lonely_leader(path: str, init_method: str, status, told) -> None:
    from tandem.engine.tensor_parallel import TPGroupLost

    torch.set_num_threads(1)
    group = TPGroup(0, 2, init_method, torch.device("cpu"))
    model, config = load_model(path, dtype=torch.float32, tp_rank=0, tp_size=2)
    runner = ModelRunner.from_model(model, config, num_blocks=32, block_size=BLOCK, tp=group)
    status.put("ready")
    told.get()  # the follower was killed
    try:
        runner.forward([SeqChunk(A, 0, list(range(8)))])
    except TPGroupLost as exc:
        status.put(f"lost: {exc}")
        return
    status.put("forward returned")


def _doomed_follower(path: str, init_method: str) -> None:
    torch.set_num_threads(1)
    group = TPGroup(1, 2, init_method, torch.device("cpu"))
    model, config = load_model(path, dtype=torch.float32, tp_rank=1, tp_size=2)
    ModelRunner.from_model(model, config, num_blocks=32, block_size=BLOCK, tp=group).follow()


def test_a_dead_rank_is_fatal_to_the_leader_s_next_forward(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    ctx = multiprocessing.get_context("spawn")
    # one queue each way: the test never reads back its own message
    init, status, told = f"tcp://127.0.0.1:{_free_port()}", ctx.Queue(), ctx.Queue()
    leader = ctx.Process(target=_lonely_leader, args=(path, init, status, told))
    follower = ctx.Process(target=_doomed_follower, args=(path, init))
    leader.start()
    follower.start()
    assert status.get(timeout=240) == "ready"
    follower.kill()
    follower.join(30)
    told.put("killed")
    assert status.get(timeout=120).startswith("lost:")
    leader.join(30)
    assert leader.exitcode == 0


def test_a_degree_the_shape_does_not_split_into_is_refused(tmp_path):
    config = ModelConfig.from_pretrained(make_tiny_checkpoint(tmp_path / "llama", "llama"))  # 4 query, 2 KV heads
    assert shard_config(config, 2).num_kv_heads == 1 and shard_config(config, 2).num_q_heads == 2
    with pytest.raises(ValueError, match="does not divide the model's KV heads 2"):
        check_tp_size(config, 4)
