"""FP8 KV pools through the GPU transports, between processes: cuda_ipc on one GPU, nccl between two
(a uint8 payload: no float8 dtype in the collective); every block arrives bit for bit."""

import multiprocessing as mp
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

F8 = torch.float8_e4m3fn
LAYOUT = dict(num_layers=4, num_blocks=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=F8)
SRC_SHAPE = (4, 2, 32, 16, 8, 128)
SRC_IDS, DST_IDS = [3, 1, 30, 9], [0, 17, 5, 31]


def _scales():
    return {"k_scale": torch.full((4, 8), 2.0**-4), "v_scale": torch.full((4, 8), 2.0**-6)}


def _codes(device):
    """Every E4M3 code but NaN's, seeded."""
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, SRC_SHAPE, dtype=torch.uint8, generator=generator)
    codes[(codes & 0x7F) == 0x7F] -= 1
    return codes.view(F8).to(device)


def _send(transport_name, endpoint, device, results):
    from tandem.kvtransfer import KVPoll, KVSender, get_transport

    torch.cuda.set_device(device)
    sender = KVSender(get_transport(transport_name).connect(endpoint), DST_IDS)
    sender.send_blocks(_codes(f"cuda:{device}"), SRC_IDS, 0)
    sender.finish()
    deadline = time.monotonic() + 120
    while (status := sender.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.0005)
    results.put((status.value, sender.error))


def _check(pool):
    src = _codes("cuda:0").view(torch.uint8)
    for s, d in zip(SRC_IDS, DST_IDS):
        assert torch.equal(pool.kv[:, :, d].view(torch.uint8), src[:, :, s])
    others = [b for b in range(LAYOUT["num_blocks"]) if b not in DST_IDS]
    assert torch.count_nonzero(pool.kv[:, :, others].view(torch.uint8)) == 0


def _run(transport_name, sender_device):
    from tandem.engine.kv_cache import KVCachePool
    from tandem.kvtransfer import get_transport

    pool = KVCachePool(**LAYOUT, device="cuda:0", **_scales())
    transport = get_transport(transport_name)
    try:
        endpoint = transport.export_pool(pool)
        assert endpoint["kv_format"] == pool.kv_format()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_send, args=(transport_name, endpoint, sender_device, results), daemon=True)
        child.start()
        assert results.get(timeout=180) == ("success", None)
        child.join(60)
        _check(pool)
    finally:
        if hasattr(transport, "close"):
            transport.close()


def test_cuda_ipc_moves_fp8_blocks_bit_for_bit():
    _run("cuda_ipc", 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_moves_fp8_blocks_between_gpus_bit_for_bit():
    _run("nccl", 1)
