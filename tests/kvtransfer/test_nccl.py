"""nccl transport on the CPU (gloo backend): real process pairs, byte-exact blocks, dead and hung peers."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer import KVPoll, KVSender, get_transport
from tandem.kvtransfer.base import TransferError
from tandem.kvtransfer.nccl import NcclTransport

LAYOUT = dict(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
SRC_SHAPE = (2, 2, 12, 4, 2, 8)  # the prefill worker's pool: [L, 2, N, bs, H, D]
TIMEOUT_S = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _chunks(src):
    """The prefill worker's pattern: (source block ids, first destination index) per
    chunk; a chunk re-sends the block the previous one left partly filled, after the
    next forward wrote more of it."""
    yield [3, 9], 0
    src[:, :, 9] += 1
    yield [9, 4, 11], 1
    src[:, :, 11] -= 1
    yield [11, 0], 3


def _source(dtype_name, seed):
    torch.manual_seed(seed)
    return torch.randn(SRC_SHAPE, dtype=DTYPES[dtype_name])


def _expected(dtype_name, seed, dst_block_ids):
    """dst block id -> the contents it must end up with (the last write wins)."""
    src, expected = _source(dtype_name, seed), {}
    for src_ids, first in _chunks(src):
        for i, block in enumerate(src_ids):
            expected[dst_block_ids[first + i]] = src[:, :, block].clone()
    return expected


def _settle(sender, timeout_s):
    deadline = time.monotonic() + timeout_s
    while (status := sender.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.001)
    return status


def _send_chunks(endpoint, dtype_name, seed, dst_block_ids, results, reconnect=False):
    transport = NcclTransport(timeout_s=TIMEOUT_S)
    connection = transport.connect(endpoint)
    sender = KVSender(connection, dst_block_ids)
    src = _source(dtype_name, seed)
    for src_ids, first in _chunks(src):
        sender.send_blocks(src, src_ids, first)
        sender.poll()  # the worker loop polls once per step, between chunks
        if reconnect and first == 1:  # a pair that breaks and forms again
            assert _settle(sender, 10 * TIMEOUT_S) is KVPoll.WAITING_FOR_INPUT, sender.error
            connection.close()
            sender = KVSender(transport.connect(endpoint), dst_block_ids)
    sender.finish()
    results.put((seed, _settle(sender, 10 * TIMEOUT_S).value, sender.error))


def _export_and_wait(endpoint_queue, got_chunk, hang):
    """A decode side in its own process; ``hang``: its receive thread stalls on the
    first chunk's payload (alive, never acks)."""
    from tandem.kvtransfer import nccl_recv

    if hang:
        def stall(*_args):
            got_chunk.set()
            time.sleep(3600)

        nccl_recv.PoolServer._apply = stall
    pool = KVCachePool(**LAYOUT, dtype=torch.float32)
    endpoint_queue.put(NcclTransport(timeout_s=TIMEOUT_S).export_pool(pool))
    time.sleep(3600)


def _spawn(ctx, target, *args):
    process = ctx.Process(target=target, args=args, daemon=True)
    process.start()
    return process


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_nccl_moves_chunks_between_processes_byte_exact(dtype_name):
    pool = KVCachePool(**LAYOUT, dtype=DTYPES[dtype_name])
    transport = NcclTransport(timeout_s=TIMEOUT_S)
    try:
        endpoint = transport.export_pool(pool)
        assert endpoint["backend"] == "gloo"
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        dst_block_ids = [14, 2, 7, 5, 10]
        child = _spawn(ctx, _send_chunks, endpoint, dtype_name, 1234, dst_block_ids, results)
        assert results.get(timeout=60) == (1234, "success", None)
        child.join(30)
        assert child.exitcode == 0
        expected = _expected(dtype_name, 1234, dst_block_ids)
        for block, contents in expected.items():
            assert torch.equal(pool.kv[:, :, block].view(torch.uint8), contents.view(torch.uint8)), block
        untouched = [b for b in range(LAYOUT["num_blocks"]) if b not in expected]
        assert torch.count_nonzero(pool.kv[:, :, untouched]) == 0
    finally:
        transport.close()


def test_two_senders_pair_with_one_receiver_concurrently():
    pool = KVCachePool(**LAYOUT, dtype=torch.float32)
    transport = NcclTransport(timeout_s=TIMEOUT_S)
    try:
        endpoint = transport.export_pool(pool)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        plans = {1: [0, 1, 2, 3, 4], 2: [15, 13, 11, 9, 8]}
        children = [
            _spawn(ctx, _send_chunks, endpoint, "float32", 1, plans[1], results),
            _spawn(ctx, _send_chunks, endpoint, "float32", 2, plans[2], results, True),
        ]
        assert sorted(results.get(timeout=60) for _ in children) == [(1, "success", None), (2, "success", None)]
        for child in children:
            child.join(30)
            assert child.exitcode == 0
        touched = set()
        for seed, dst_block_ids in plans.items():
            for block, contents in _expected("float32", seed, dst_block_ids).items():
                assert torch.equal(pool.kv[:, :, block], contents), (seed, block)
                touched.add(block)
        untouched = [b for b in range(LAYOUT["num_blocks"]) if b not in touched]
        assert torch.count_nonzero(pool.kv[:, :, untouched]) == 0
    finally:
        transport.close()


def _start_receiver(hang=False):
    ctx = mp.get_context("spawn")
    endpoints, got_chunk = ctx.Queue(), ctx.Event()
    receiver = _spawn(ctx, _export_and_wait, endpoints, got_chunk, hang)
    return receiver, endpoints.get(timeout=60), got_chunk


def test_receiver_dead_before_connect_fails_within_the_timeout():
    receiver, endpoint, _ = _start_receiver()
    os.kill(receiver.pid, signal.SIGKILL)
    receiver.join(10)
    sender = KVSender(NcclTransport(timeout_s=TIMEOUT_S).connect(endpoint), [0, 1])
    started = time.monotonic()
    sender.send_blocks(torch.ones(SRC_SHAPE), [0, 1], 0)
    sender.finish()
    assert _settle(sender, 10 * TIMEOUT_S) is KVPoll.FAILED
    assert time.monotonic() - started < TIMEOUT_S + 2
    assert f"127.0.0.1:{endpoint['ctrl_port']}" in sender.error


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_receiver_lost_mid_transfer_fails_the_sender_not_its_loop(how):
    receiver, endpoint, got_chunk = _start_receiver(hang=how == "hung")
    try:
        connection = NcclTransport(timeout_s=TIMEOUT_S).connect(endpoint)
        sender = KVSender(connection, list(range(8)))
        src = torch.ones(SRC_SHAPE)
        if how == "killed":  # one chunk lands, the next is in flight when the receiver dies
            sender.send_blocks(src, [0, 1], 0)
            assert _settle(sender, 10 * TIMEOUT_S) is KVPoll.WAITING_FOR_INPUT, sender.error
            os.kill(receiver.pid, signal.SIGSTOP)  # so the next chunk cannot be acked before the kill
            sender.send_blocks(src, [2, 3], 2)
            assert sender.poll() is KVPoll.TRANSFERRING
            os.kill(receiver.pid, signal.SIGKILL)
        else:
            sender.send_blocks(src, [0, 1], 0)
            while not got_chunk.wait(0.001):  # the worker loop's polls issue the queued chunk
                assert sender.poll() is KVPoll.TRANSFERRING
        started = time.monotonic()
        status = _settle(sender, 10 * TIMEOUT_S)
        elapsed = time.monotonic() - started
        assert status is KVPoll.FAILED, status
        assert elapsed < (1.0 if how == "killed" else TIMEOUT_S + 1.0), elapsed
        assert sender.error
    finally:
        os.kill(receiver.pid, signal.SIGKILL)
        receiver.join(10)


def _send_and_linger(endpoint, results, release):
    sender = KVSender(NcclTransport(timeout_s=TIMEOUT_S).connect(endpoint), [5, 6])
    sender.send_blocks(torch.ones(SRC_SHAPE), [0, 1], 0)
    sender.finish()
    results.put((_settle(sender, 10 * TIMEOUT_S).value, sender.error))
    release.wait(60)  # keep this end of the pair alive: only the give-up may stop the chunk


def test_a_chunk_whose_sender_gave_up_is_not_applied(monkeypatch):
    from tandem.kvtransfer import nccl_pair

    outcomes, check = [], nccl_pair.Frames.peer_gave_up

    def late_check(self):  # the payload is in; the sender's deadline for its ack passes meanwhile
        time.sleep(TIMEOUT_S + 1)
        outcomes.append(check(self))
        return outcomes[-1]

    monkeypatch.setattr(nccl_pair.Frames, "peer_gave_up", late_check)
    pool = KVCachePool(**LAYOUT, dtype=torch.float32)
    transport = NcclTransport(timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    try:
        sender = _spawn(ctx, _send_and_linger, transport.export_pool(pool), results, release)
        status, error = results.get(timeout=60)
        assert status == "failed" and "no ack" in error
        deadline = time.monotonic() + 10 * TIMEOUT_S
        while not outcomes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outcomes == [True]
        time.sleep(0.1)
        assert torch.count_nonzero(pool.kv) == 0
    finally:
        release.set()
        transport.close()
    sender.join(30)


def test_registered_and_checks_layout_before_sending():
    transport = get_transport("nccl")
    assert isinstance(transport, NcclTransport)
    endpoint = {"transport": "nccl", "backend": "gloo", "host": "127.0.0.1", "store_port": 1, "ctrl_port": 1,
                "layout": {**LAYOUT, "dtype": "float32"}}
    connection = transport.connect(endpoint)
    src = torch.zeros(SRC_SHAPE)
    with pytest.raises(TransferError, match="layouts differ"):
        connection.write(src.to(torch.bfloat16), [0], [0])
    with pytest.raises(TransferError, match="outside the peer pool"):
        connection.write(src, [0], [LAYOUT["num_blocks"]])
    with pytest.raises(TransferError, match="not an nccl KV endpoint"):
        transport.connect({"transport": "shm", "path": "/dev/shm/x"})
    assert connection.write(src, [], []).done()


def test_nccl_is_asked_for_explicitly():
    import argparse

    from tandem.cluster.settings import add_arguments
    from tandem.engine.runner_factory import resolve_transport

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--kv-transport", "nccl"]).kv_transport == "nccl"
    assert resolve_transport("nccl", torch.device("cpu")) == "nccl"
    assert resolve_transport("auto", torch.device("cpu")) == "shm"
    assert resolve_transport("auto", torch.device("cuda")) == "cuda_ipc"
