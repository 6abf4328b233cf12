"""kvtransfer: the poll() state machines and the shm transport across processes."""

import multiprocessing as mp

import pytest
import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer import KVPoll, KVReceiver, KVSender, get_transport
from tandem.kvtransfer.base import Connection, Transfer, TransferError

LAYOUT = dict(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _child_write(endpoint, src_ids, dst_ids, seed):
    transport = get_transport("shm")
    conn = transport.connect(endpoint)
    torch.manual_seed(seed)
    src = torch.randn(2, 2, 8, 4, 2, 8)
    sender = KVSender(conn, dst_ids)
    sender.send_blocks(src, src_ids, 0)
    sender.finish()
    assert sender.poll() is KVPoll.SUCCESS


def test_shm_transport_moves_blocks_between_processes_byte_exact(tmp_path):
    pool = KVCachePool.create_shared(str(tmp_path / "pool"), **LAYOUT)
    try:
        endpoint = get_transport("shm").export_pool(pool)
        ctx = mp.get_context("spawn")
        child = ctx.Process(target=_child_write, args=(endpoint, [1, 5, 6], [7, 0, 3], 1234))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        torch.manual_seed(1234)
        src = torch.randn(2, 2, 8, 4, 2, 8)
        for s, d in zip([1, 5, 6], [7, 0, 3]):
            assert torch.equal(pool.kv[:, :, d], src[:, :, s])
        untouched = [b for b in range(8) if b not in (7, 0, 3)]
        assert torch.count_nonzero(pool.kv[:, :, untouched]) == 0
    finally:
        pool.close()


def test_shm_export_needs_a_shared_pool():
    pool = KVCachePool(**LAYOUT)
    with pytest.raises(TransferError):
        get_transport("shm").export_pool(pool)


def test_connect_to_missing_pool_fails_clearly(tmp_path):
    endpoint = {"transport": "shm", "path": str(tmp_path / "gone"), "layout": {**LAYOUT, "dtype": "float32"}}
    with pytest.raises(TransferError, match="cannot map"):
        get_transport("shm").connect(endpoint)


def test_unknown_transport():
    with pytest.raises(ValueError, match="unknown kv transport"):
        get_transport("carrier-pigeon")


class _SlowTransfer(Transfer):
    def __init__(self, polls_left, fail=False):
        self.polls_left, self.fail = polls_left, fail

    def done(self):
        self.polls_left -= 1
        if self.polls_left > 0:
            return False
        if self.fail:
            raise TransferError("link down")
        return True


class _AsyncConnection(Connection):
    def __init__(self, fail=False):
        self.fail = fail

    def write(self, src_kv, src_block_ids, dst_block_ids, handoff_id=None):
        return _SlowTransfer(2, self.fail)


def test_sender_state_machine():
    assert KVSender(None, [0]).poll() is KVPoll.BOOTSTRAPPING
    sender = KVSender(_AsyncConnection(), [4, 5])
    assert sender.poll() is KVPoll.WAITING_FOR_INPUT
    sender.send_blocks(torch.zeros(1), [0], 0)
    assert sender.poll() is KVPoll.TRANSFERRING
    sender.finish()
    assert sender.poll() is KVPoll.SUCCESS


def test_sender_failure_and_overflow():
    failing = KVSender(_AsyncConnection(fail=True), [4])
    failing.send_blocks(torch.zeros(1), [0], 0)
    assert failing.poll() is KVPoll.TRANSFERRING
    assert failing.poll() is KVPoll.FAILED and "link down" in failing.error
    short = KVSender(_AsyncConnection(), [4])
    short.send_blocks(torch.zeros(1), [0, 1], 0)
    assert short.poll() is KVPoll.FAILED and "reserved" in short.error


def test_receiver_done_failed_and_timeout():
    ok = KVReceiver(timeout_s=10, now=0)
    assert ok.poll(now=1) is KVPoll.WAITING_FOR_INPUT
    ok.on_done(True)
    assert ok.poll(now=100) is KVPoll.SUCCESS
    late = KVReceiver(timeout_s=10, now=0)
    assert late.poll(now=11) is KVPoll.FAILED and "timed out" in late.error
    late.on_done(True)  # a late success does not resurrect it
    assert late.poll(now=12) is KVPoll.FAILED


class _ScriptedConnection(Connection):
    """write() returns the transfers it is given, in order."""

    def __init__(self, transfers):
        self.transfers = list(transfers)

    def write(self, src_kv, src_block_ids, dst_block_ids, handoff_id=None):
        return self.transfers.pop(0)


def test_a_failed_handoff_reads_failed_only_once_its_other_writes_are_done():
    """PrefillDone (which hands the destination blocks back) follows FAILED: a write still in
    flight could otherwise land in blocks the decode worker has freed."""
    slow, failing = _SlowTransfer(4), _SlowTransfer(1, fail=True)
    sender = KVSender(_ScriptedConnection([slow, failing]), [4, 5, 6])
    sender.send_blocks(torch.zeros(1), [0], 0)
    sender.send_blocks(torch.zeros(1), [1], 1)
    assert sender.poll() is KVPoll.TRANSFERRING and "link down" in sender.error  # the slow one still writes
    assert sender.poll() is KVPoll.TRANSFERRING
    assert sender.poll() is KVPoll.TRANSFERRING
    assert sender.poll() is KVPoll.FAILED and slow.polls_left == 0
    overflow = KVSender(_ScriptedConnection([_SlowTransfer(2)]), [4])
    overflow.send_blocks(torch.zeros(1), [0], 0)
    overflow.send_blocks(torch.zeros(1), [1], 1)  # past the reserved blocks: fails, the first is in flight
    assert overflow.poll() is KVPoll.TRANSFERRING and "reserved" in overflow.error
    assert overflow.poll() is KVPoll.FAILED


@pytest.mark.parametrize("src_ranks, dst_ranks", [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_shm_moves_each_head_to_the_rank_that_holds_it(tmp_path, src_ranks, dst_ranks):
    """Split models (engine.tensor_parallel): a source of M ranks' parts and a destination of N
    ranks' pool files, each holding its share of 4 KV heads; every head lands where it belongs."""
    heads = 4
    full = torch.randn(2, 2, 8, 4, heads, 8)
    per_src = heads // src_ranks
    src = [(full[..., r * per_src : (r + 1) * per_src, :].contiguous(), r * per_src) for r in range(src_ranks)]
    per_dst = heads // dst_ranks
    layout = dict(LAYOUT, num_kv_heads=per_dst)
    pools = [KVCachePool.create_shared(str(tmp_path / f"pool{r}"), **layout) for r in range(dst_ranks)]
    try:
        transport = get_transport("shm")
        endpoint = transport.export_pool(pools[0], pools[1:])
        assert [r["first_head"] for r in endpoint.get("ranks", [{"first_head": 0}])] == [r * per_dst for r in range(dst_ranks)]
        conn = transport.connect(endpoint)
        conn.write(src if src_ranks > 1 else src[0][0], [1, 5, 6], [7, 0, 3])
        whole = torch.cat([p.kv for p in pools], dim=4)
        for s, d in zip([1, 5, 6], [7, 0, 3]):
            assert torch.equal(whole[:, :, d], full[:, :, s])
        assert torch.count_nonzero(whole[:, :, [2, 4]]) == 0
        conn.close()
        with pytest.raises(TransferError, match="different KV heads"):
            transport.connect(endpoint).write([(src[0][0], 0)] if src_ranks > 1 else [(src[0][0][..., :2, :], 0)],
                                              [1], [2])
    finally:
        for p in pools:
            p.close()
