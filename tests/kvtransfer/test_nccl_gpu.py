"""nccl transport between two processes on two GPUs (NCCL backend; needs 2 CUDA devices)."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

LAYOUT = dict(num_layers=4, num_blocks=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
SRC_SHAPE = (4, 2, 24, 16, 8, 128)
TIMEOUT_S = 5.0
DST_BLOCK_IDS = [30, 2, 17, 5, 11]


def _source(device):
    torch.manual_seed(7)
    return torch.randn(SRC_SHAPE).to(torch.bfloat16).to(device)


def _chunks(src):
    """As the prefill worker sends them; the in-place updates run on the compute
    stream right before the next send, so the gather must wait for them."""
    yield [3, 9], 0
    src[:, :, 9] += 1
    yield [9, 4, 21], 1
    src[:, :, 21] -= 1
    yield [21, 0], 3


def _settle(sender, timeout_s):
    from tandem.kvtransfer import KVPoll

    deadline = time.monotonic() + timeout_s
    while (status := sender.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.0005)
    return status


def _send_from_gpu1(endpoint, results):
    from tandem.kvtransfer import KVSender
    from tandem.kvtransfer.nccl import NcclTransport

    torch.cuda.set_device(1)
    src = _source("cuda:1")
    sender = KVSender(NcclTransport(timeout_s=TIMEOUT_S).connect(endpoint), DST_BLOCK_IDS)
    for src_ids, first in _chunks(src):
        sender.send_blocks(src, src_ids, first)
        sender.poll()
    sender.finish()
    results.put((_settle(sender, 10 * TIMEOUT_S).value, sender.error))


def _receive_on_gpu0(endpoints):
    from tandem.engine.kv_cache import KVCachePool
    from tandem.kvtransfer.nccl import NcclTransport

    torch.cuda.set_device(0)
    pool = KVCachePool(**LAYOUT, device="cuda:0")
    endpoints.put(NcclTransport(timeout_s=TIMEOUT_S).export_pool(pool))
    time.sleep(3600)


def test_nccl_moves_chunks_between_gpus_byte_exact():
    from tandem.engine.kv_cache import KVCachePool
    from tandem.kvtransfer.nccl import NcclTransport

    pool = KVCachePool(**LAYOUT, device="cuda:0")
    transport = NcclTransport(timeout_s=TIMEOUT_S)
    try:
        endpoint = transport.export_pool(pool)
        assert endpoint["backend"] == "nccl"
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_send_from_gpu1, args=(endpoint, results), daemon=True)
        child.start()
        assert results.get(timeout=120) == ("success", None)
        child.join(60)
        src, expected = _source("cuda:0"), {}
        for src_ids, first in _chunks(src):
            for i, block in enumerate(src_ids):
                expected[DST_BLOCK_IDS[first + i]] = src[:, :, block].clone()
        for block, contents in expected.items():
            assert torch.equal(pool.kv[:, :, block], contents), block
        untouched = [b for b in range(LAYOUT["num_blocks"]) if b not in expected]
        assert torch.count_nonzero(pool.kv[:, :, untouched]) == 0
    finally:
        transport.close()


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_lost_receiver_fails_the_sender_and_the_gpu_keeps_working(how):
    from tandem.kvtransfer import KVPoll, KVSender
    from tandem.kvtransfer.nccl import NcclTransport

    ctx = mp.get_context("spawn")
    endpoints = ctx.Queue()
    receiver = ctx.Process(target=_receive_on_gpu0, args=(endpoints,), daemon=True)
    receiver.start()
    try:
        endpoint = endpoints.get(timeout=120)
        torch.cuda.set_device(1)
        src = _source("cuda:1")
        sender = KVSender(NcclTransport(timeout_s=TIMEOUT_S).connect(endpoint), list(range(8)))
        sender.send_blocks(src, [0, 1], 0)
        assert _settle(sender, 10 * TIMEOUT_S) is KVPoll.WAITING_FOR_INPUT, sender.error
        os.kill(receiver.pid, signal.SIGSTOP)  # the next chunk's NCCL send finds no receive
        sender.send_blocks(src, [2, 3], 2)
        if how == "killed":
            os.kill(receiver.pid, signal.SIGKILL)
        started = time.monotonic()
        assert _settle(sender, 10 * TIMEOUT_S) is KVPoll.FAILED
        assert time.monotonic() - started < TIMEOUT_S + 2
        # the communicator was aborted, not the process: the device still computes
        assert torch.ones(4, device="cuda:1").sum().item() == 4
    finally:
        os.kill(receiver.pid, signal.SIGKILL)
        receiver.join(30)
