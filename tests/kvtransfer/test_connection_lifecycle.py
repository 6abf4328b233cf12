"""A prefill worker's connections to decode pools: one per pool; a decode worker that comes back
with a new pool gets a new connection and the old one is closed (its mapping let go), so writes
of jobs for the old pool fail instead of leaking or landing."""

import types

import pytest
import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer import KVPoll, KVSender, get_transport
from tandem.kvtransfer.base import Connection, TransferError
from tandem.prefill.worker import PrefillWorker

LAYOUT = dict(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def test_a_closed_shm_connection_refuses_writes_and_unmaps(tmp_path):
    pool = KVCachePool.create_shared(str(tmp_path / "pool"), **LAYOUT)
    try:
        connection = get_transport("shm").connect(get_transport("shm").export_pool(pool))
        sender = KVSender(connection, [0])
        sender.send_blocks(torch.ones(1, 2, 4, 2, 1, 4), [1], 0)
        assert torch.count_nonzero(pool.kv[:, :, 0]) == 16  # the whole block: K and V
        connection.close()
        assert connection._pools is None  # the peer's mapping is let go
        late = KVSender(connection, [2])
        late.send_blocks(torch.ones(1, 2, 4, 2, 1, 4), [1], 0)
        assert late.poll() is KVPoll.FAILED and "closed" in late.error
        assert torch.count_nonzero(pool.kv[:, :, 2]) == 0
    finally:
        pool.close()


class _Connection(Connection):
    def __init__(self, endpoint):
        self.endpoint, self.closed = endpoint, False

    def write(self, src_kv, src_block_ids, dst_block_ids, handoff_id=None):
        raise AssertionError("not written in this test")

    def close(self):
        self.closed = True


def _job(decode_worker_id, path):
    return types.SimpleNamespace(decode_worker_id=decode_worker_id, kv_endpoint={"transport": "fake", "path": path})


def test_a_decode_worker_back_with_a_new_pool_gets_a_new_connection_and_the_old_one_closes():
    worker = object.__new__(PrefillWorker)
    worker.transport = types.SimpleNamespace(connect=_Connection)
    worker._connections, worker._pool_of = {}, {}
    first = worker._connect(_job("decode-0", "/dev/shm/tandem-kv-decode-0-100"))
    assert worker._connect(_job("decode-0", "/dev/shm/tandem-kv-decode-0-100")) is first  # one per pool
    other = worker._connect(_job("decode-1", "/dev/shm/tandem-kv-decode-1-200"))
    again = worker._connect(_job("decode-0", "/dev/shm/tandem-kv-decode-0-300"))  # decode-0 restarted
    assert again is not first and first.closed and not other.closed and not again.closed
    assert set(worker._connections) == {("decode-1", "/dev/shm/tandem-kv-decode-1-200"),
                                        ("decode-0", "/dev/shm/tandem-kv-decode-0-300")}
    # an endpoint another worker had before (nccl: host and ports) is that worker's own connection
    reused = worker._connect(_job("decode-2", "/dev/shm/tandem-kv-decode-0-100"))
    assert reused is not first and not again.closed and not other.closed


def test_closed_nccl_connection_refuses_writes():
    from tandem.kvtransfer.nccl import NcclConnection

    layout = {"num_layers": 1, "block_size": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32"}
    connection = NcclConnection({"layout": layout, "backend": "gloo"}, timeout_s=1.0)
    connection.close()
    with pytest.raises(TransferError, match="closed"):
        connection.write(torch.zeros(1), [0], [0])
