"""nccl transport grants (gloo on the CPU): a chunk lands only while its handoff holds a grant."""

import multiprocessing as mp
import time

import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer import KVPoll, KVSender
from tandem.kvtransfer.nccl import NcclTransport

LAYOUT = dict(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
SRC_SHAPE = (2, 2, 6, 4, 2, 8)
TIMEOUT_S = 5.0


def _settle(sender, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while (status := sender.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.001)
    return status


def _sender(endpoint, results, go_on):
    """Handoff 'r#1' sends blocks 0-1, waits, then 2-3; handoff 'r#9' (never granted) sends one block."""
    connection = NcclTransport(timeout_s=TIMEOUT_S).connect(endpoint)
    src = torch.arange(torch.Size(SRC_SHAPE).numel(), dtype=torch.float32).reshape(SRC_SHAPE)
    sender = KVSender(connection, [3, 5, 7, 9], "r#1")
    sender.send_blocks(src, [0, 1], 0)
    results.put(("first", _settle(sender).value, sender.error))
    go_on.wait(60)
    sender.send_blocks(src, [2, 3], 2)
    results.put(("second", _settle(sender).value, sender.error))
    stranger = KVSender(connection, [11], "r#9")
    stranger.send_blocks(src, [4], 0)
    results.put(("stranger", _settle(stranger).value, stranger.error))
    go_on.wait(60)


def test_chunks_land_only_while_their_handoff_is_granted():
    pool = KVCachePool(**LAYOUT, dtype=torch.float32)
    transport = NcclTransport(timeout_s=TIMEOUT_S)
    endpoint = transport.export_pool(pool)
    transport.grant("r#1", [3, 5, 7, 9])
    ctx = mp.get_context("spawn")
    results, go_on = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_sender, args=(endpoint, results, go_on), daemon=True)
    child.start()
    try:
        assert results.get(timeout=120) == ("first", "waiting_for_input", None)
        src = torch.arange(torch.Size(SRC_SHAPE).numel(), dtype=torch.float32).reshape(SRC_SHAPE)
        assert torch.equal(pool.kv[:, :, [3, 5]], src[:, :, [0, 1]])
        transport.revoke("r#1")  # the handoff ended (say, its deadline passed): the blocks are freed next
        go_on.set()
        name, status, error = results.get(timeout=60)
        assert (name, status) == ("second", "failed") and "no grant" in error
        name, status, error = results.get(timeout=60)
        assert (name, status) == ("stranger", "failed") and "r#9 holds no grant" in error
        assert torch.count_nonzero(pool.kv[:, :, [7, 9, 11]]) == 0
        assert torch.equal(pool.kv[:, :, [3, 5]], src[:, :, [0, 1]])
    finally:
        go_on.set()
        transport.close()
        child.join(30)


def test_control_frames_are_not_delayed_by_nagle():
    import socket

    from tandem.kvtransfer.nccl_pair import Frames

    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            server, _ = listener.accept()
            with server:
                for sock in (client, server):
                    Frames(sock)
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
