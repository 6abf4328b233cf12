"""KV pool layout and the /dev/shm pool shared between two processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import msgpack
import pytest
import torch

from tandem.engine.kv_cache import KVCachePool

LAYOUT = {"num_layers": 2, "num_blocks": 6, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}


def _pattern(seed: int, shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _peer(path: str, packed_layout: bytes, seed: int) -> None:
    """Runs in a spawned process: attach, check the creator's bytes, write our own into blocks 3..5."""
    pool = KVCachePool.attach_shared(path, **msgpack.unpackb(packed_layout))
    mine = pool.kv[:, :, 3:]
    theirs = pool.kv[:, :, :3]
    if not torch.equal(theirs.view(torch.uint8), _pattern(seed, theirs.shape, pool.dtype).view(torch.uint8)):
        raise SystemExit(3)
    mine.copy_(_pattern(seed + 1, mine.shape, pool.dtype))
    pool.close()


@pytest.fixture
def shm_path():
    root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    path = os.path.join(root, f"tandem-test-kv-{uuid.uuid4().hex}")
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_layer_views_share_the_pool():
    pool = KVCachePool(**LAYOUT, dtype=torch.float32, device="cpu")
    assert pool.kv.shape == (2, 2, 6, 4, 2, 8)
    k, v = pool.layer(1)
    assert k.shape == (6, 4, 2, 8)
    k[2, 3] = 1.0
    v[0, 0] = 2.0
    assert pool.kv[1, 0, 2, 3].eq(1).all() and pool.kv[1, 1, 0, 0].eq(2).all()
    assert pool.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_pool_across_processes_is_byte_exact(shm_path, dtype):
    pool = KVCachePool.create_shared(shm_path, **LAYOUT, dtype=dtype)
    assert os.path.getsize(shm_path) == pool.kv.numel() * pool.kv.element_size()
    assert pool.kv.abs().sum() == 0
    first = pool.kv[:, :, :3]
    first.copy_(_pattern(11, first.shape, dtype))

    layout = pool.layout()
    assert layout == {**LAYOUT, "dtype": str(dtype).removeprefix("torch.")}
    peer = mp.get_context("spawn").Process(target=_peer, args=(shm_path, msgpack.packb(layout), 11))
    peer.start()
    peer.join(timeout=120)
    assert peer.exitcode == 0

    second = pool.kv[:, :, 3:]
    assert torch.equal(second.view(torch.uint8), _pattern(12, second.shape, dtype).view(torch.uint8))
    pool.close()
    assert not os.path.exists(shm_path)


def test_attach_checks_size_and_create_rezeroes(shm_path):
    pool = KVCachePool.create_shared(shm_path, **LAYOUT, dtype=torch.float32)
    pool.kv.fill_(1.0)
    with pytest.raises(ValueError, match="bytes"):
        KVCachePool.attach_shared(shm_path, **{**LAYOUT, "num_blocks": 7}, dtype="float32")
    attached = KVCachePool.attach_shared(shm_path, **LAYOUT, dtype="float32")
    assert attached.kv.eq(1.0).all()  # same memory, no copy
    attached.close()
    assert os.path.exists(shm_path)  # only the creator unlinks
    pool.close()
    again = KVCachePool.create_shared(shm_path, **LAYOUT, dtype=torch.float32)
    assert again.kv.abs().sum() == 0
    again.close()


def test_shared_pool_must_be_on_cpu(shm_path):
    with pytest.raises(ValueError, match="CPU"):
        KVCachePool(**LAYOUT, dtype=torch.float32, device="meta", shm_path=shm_path)
