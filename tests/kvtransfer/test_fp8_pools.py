"""FP8 KV pools through the transports: blocks of E4M3 codes arrive bit for bit (shm, and nccl
over gloo, between processes), every endpoint names its pool's format (dtype and scales), and a
prefill worker whose pool differs from the decode worker's is told why instead of writing."""

import multiprocessing as mp
import time

import pytest
import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer import KVPoll, KVSender, get_transport
from tandem.kvtransfer.base import TransferError
from tandem.kvtransfer.nccl import NcclTransport
from tandem.kvtransfer.sender import kv_format_mismatch

F8 = torch.float8_e4m3fn
LAYOUT = dict(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
SRC_SHAPE = (2, 2, 8, 4, 2, 8)
SRC_IDS, DST_IDS = [1, 5, 6], [7, 0, 3]


def _scales(seed=0):
    k = torch.tensor([[2.0**-4, 2.0**-3], [2.0**-5, 1.0]]) * (2 if seed else 1)
    return {"k_scale": k, "v_scale": k / 4}


def _codes(seed: int) -> torch.Tensor:
    """A prefill pool's blocks: every E4M3 code but NaN's, in a seeded order."""
    torch.manual_seed(seed)
    values = torch.randint(0, 256, SRC_SHAPE, dtype=torch.uint8)
    values[values == 0x7F] = 0x7E
    values[values == 0xFF] = 0xFE
    return values.view(F8)


def _shm_child(endpoint, seed):
    conn = get_transport("shm").connect(endpoint)
    sender = KVSender(conn, DST_IDS)
    sender.send_blocks(_codes(seed), SRC_IDS, 0)
    sender.finish()
    assert sender.poll() is KVPoll.SUCCESS, sender.error


def _nccl_child(endpoint, seed, results):
    sender = KVSender(NcclTransport(timeout_s=5.0).connect(endpoint), DST_IDS)
    sender.send_blocks(_codes(seed), SRC_IDS, 0)
    sender.finish()
    deadline = time.monotonic() + 60
    while (status := sender.poll()) is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.001)
    results.put((status.value, sender.error))


def _assert_moved(pool, seed):
    src = _codes(seed)
    for s, d in zip(SRC_IDS, DST_IDS):
        assert torch.equal(pool.kv[:, :, d].view(torch.uint8), src[:, :, s].view(torch.uint8))
    untouched = [b for b in range(LAYOUT["num_blocks"]) if b not in DST_IDS]
    assert torch.count_nonzero(pool.kv[:, :, untouched].view(torch.uint8)) == 0


def test_shm_moves_fp8_blocks_between_processes_bit_for_bit(tmp_path):
    pool = KVCachePool.create_shared(str(tmp_path / "pool"), **LAYOUT, dtype=F8, **_scales())
    try:
        assert pool.bytes_per_block == 2 * 2 * 4 * 2 * 8  # one byte an element
        endpoint = get_transport("shm").export_pool(pool)
        assert endpoint["layout"]["dtype"] == "float8_e4m3fn" and endpoint["kv_format"] == pool.kv_format()
        child = mp.get_context("spawn").Process(target=_shm_child, args=(endpoint, 7))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        _assert_moved(pool, 7)
    finally:
        pool.close()


def test_nccl_over_gloo_moves_fp8_blocks_bit_for_bit():
    """The payload travels as bytes (no float8 dtype in the collective) and lands as codes."""
    pool = KVCachePool(**LAYOUT, dtype=F8, **_scales())
    transport = NcclTransport(timeout_s=5.0)
    try:
        endpoint = transport.export_pool(pool)
        assert endpoint["kv_format"] == pool.kv_format() and endpoint["layout"]["dtype"] == "float8_e4m3fn"
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_nccl_child, args=(endpoint, 11, results), daemon=True)
        child.start()
        assert results.get(timeout=90) == ("success", None)
        child.join(30)
        _assert_moved(pool, 11)
    finally:
        transport.close()


def test_the_format_names_the_dtype_and_the_scales():
    bf16 = KVCachePool(**LAYOUT, dtype=torch.bfloat16)
    assert bf16.kv_format() == {"dtype": "bfloat16", "scales": None}
    a, b, c = (KVCachePool(**LAYOUT, dtype=F8, **_scales(seed)) for seed in (0, 0, 1))
    assert a.kv_format() == b.kv_format() and a.kv_format()["scales"] != c.kv_format()["scales"]
    assert a.layer_scales(1)[0].tolist() == [2.0**-5, 1.0] and bf16.layer_scales(0) == (None, None)
    with pytest.raises(ValueError, match="FP8 pool"):
        KVCachePool(**LAYOUT, dtype=torch.bfloat16, **_scales())
    with pytest.raises(ValueError, match="finite and positive"):
        KVCachePool(**LAYOUT, dtype=F8, k_scale=torch.zeros(2, 2), v_scale=torch.ones(2, 2))


def test_a_prefill_pool_unlike_the_decode_pool_is_told_why():
    fp8, other_scales, bf16 = (KVCachePool(**LAYOUT, dtype=F8, **_scales()),
                               KVCachePool(**LAYOUT, dtype=F8, **_scales(1)),
                               KVCachePool(**LAYOUT, dtype=torch.bfloat16))
    endpoint = {"transport": "nccl", "layout": fp8.layout(), "kv_format": fp8.kv_format()}
    assert kv_format_mismatch(endpoint, KVCachePool(**LAYOUT, dtype=F8, **_scales())) is None
    assert "holds float8_e4m3fn, this prefill worker's bfloat16" in kv_format_mismatch(endpoint, bf16)
    assert "--kv-cache-dtype" in kv_format_mismatch(endpoint, bf16)
    assert "FP8 KV scales" in kv_format_mismatch(endpoint, other_scales)
    assert kv_format_mismatch({"transport": "shm"}, bf16) is None  # no format named: the write checks


def test_a_write_between_pools_of_different_dtypes_fails(tmp_path):
    pool = KVCachePool.create_shared(str(tmp_path / "pool"), **LAYOUT, dtype=F8, **_scales())
    try:
        conn = get_transport("shm").connect(get_transport("shm").export_pool(pool))
        with pytest.raises(TransferError, match="layouts differ"):
            conn.write(torch.zeros(SRC_SHAPE, dtype=torch.bfloat16), [0], [0])
        with pytest.raises(TransferError, match="layouts differ"):
            NcclTransport().connect({"transport": "nccl", "backend": "gloo", "host": "127.0.0.1", "ctrl_port": 1,
                                     "store_port": 1, "layout": pool.layout()}).write(
                torch.zeros(SRC_SHAPE, dtype=torch.bfloat16), [0], [0])
        conn.close()
    finally:
        pool.close()
