"""nccl transport (gloo on the CPU): a large write goes as several pieces and lands byte-exact."""

import multiprocessing as mp
import time

import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer import KVPoll, KVSender
from tandem.kvtransfer.nccl import NcclConnection, NcclTransport

LAYOUT = dict(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # fp32
SRC_SHAPE = (2, 2, 10, 4, 2, 8)
DST = [15, 3, 9, 0, 4, 12, 7]


def _source():
    return torch.arange(torch.Size(SRC_SHAPE).numel(), dtype=torch.float32).reshape(SRC_SHAPE)


def _send(endpoint, results):
    connection = NcclTransport(timeout_s=5.0).connect(endpoint)
    sender = KVSender(connection, DST, "h#1")
    sender.send_blocks(_source(), [9, 1, 2, 8, 0, 5, 6], 0)
    pieces = len(sender._in_flight[0]._pieces)
    sender.finish()
    deadline = time.monotonic() + 30
    while (status := sender.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.001)
    results.put((pieces, status.value, sender.error))


def test_a_large_write_is_sent_in_pieces_and_lands_byte_exact(monkeypatch):
    monkeypatch.setenv("TANDEM_KV_PIECE_BYTES", str(3 * BLOCK_BYTES))  # read by the spawned sender
    pool = KVCachePool(**LAYOUT, dtype=torch.float32)
    transport = NcclTransport(timeout_s=5.0)
    endpoint = transport.export_pool(pool)
    transport.grant("h#1", DST)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_send, args=(endpoint, results), daemon=True)
    child.start()
    try:
        assert results.get(timeout=120) == (3, "success", None)  # 7 blocks as 3 + 3 + 1
        src = _source()
        for dst, block in zip(DST, [9, 1, 2, 8, 0, 5, 6]):
            assert torch.equal(pool.kv[:, :, dst], src[:, :, block]), dst
    finally:
        transport.close()
        child.join(30)


def test_piece_size_from_the_pool_layout():
    endpoint = {"transport": "nccl", "backend": "gloo", "host": "127.0.0.1", "store_port": 1, "ctrl_port": 1,
                "layout": {**LAYOUT, "dtype": "bfloat16"}}
    assert NcclConnection(endpoint, 1.0, piece_bytes=10 * BLOCK_BYTES).blocks_per_piece == 20  # bf16: half
    assert NcclConnection(endpoint, 1.0, piece_bytes=1).blocks_per_piece == 1
