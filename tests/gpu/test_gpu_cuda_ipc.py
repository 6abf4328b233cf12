"""cuda_ipc transport between two processes on one GPU (GPU only)."""

import multiprocessing as mp

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYOUT = dict(num_layers=4, num_blocks=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def _writer(endpoint, src_ids, dst_ids, seed, result):
    from tandem.kvtransfer import KVPoll, KVSender, get_transport

    torch.manual_seed(seed)
    src = torch.randn(4, 2, 32, 16, 8, 128, device="cuda").to(torch.bfloat16)
    sender = KVSender(get_transport("cuda_ipc").connect(endpoint), dst_ids)
    sender.send_blocks(src, src_ids, 0)
    sender.finish()
    while sender.poll() is KVPoll.TRANSFERRING:
        pass
    result.put(sender.poll().value)


def test_cuda_ipc_moves_blocks_between_processes_byte_exact():
    from tandem.engine.kv_cache import KVCachePool
    from tandem.kvtransfer import get_transport

    pool = KVCachePool(**LAYOUT, device="cuda")
    endpoint = get_transport("cuda_ipc").export_pool(pool)
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    src_ids, dst_ids = [3, 1, 30], [0, 17, 5]
    child = ctx.Process(target=_writer, args=(endpoint, src_ids, dst_ids, 7, result))
    child.start()
    status = result.get(timeout=120)
    child.join(60)
    assert status == "success" and child.exitcode == 0
    torch.manual_seed(7)
    src = torch.randn(4, 2, 32, 16, 8, 128, device="cuda").to(torch.bfloat16)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(pool.kv[:, :, d], src[:, :, s])
    others = [b for b in range(32) if b not in dst_ids]
    assert torch.count_nonzero(pool.kv[:, :, others]) == 0
