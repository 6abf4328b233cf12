"""The shared KV pool file is the owner's only (0600) whatever the umask, and a link planted at
its path is not followed: the pool holds every prompt's keys and values."""

from __future__ import annotations

import os
import stat

import pytest

from tandem.engine.kv_cache import KVCachePool

LAYOUT = dict(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")


@pytest.fixture
def umask():
    old = os.umask(0)
    yield os.umask
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_the_pool_file_is_the_owners_only(tmp_path, umask, mask):
    umask(mask)
    path = tmp_path / "pool"
    pool = KVCachePool.create_shared(str(path), **LAYOUT)
    try:
        assert _mode(path) == 0o600
    finally:
        pool.close()


def test_a_stale_file_of_the_same_name_is_made_the_owners_only(tmp_path, umask):
    path = tmp_path / "pool"
    path.write_bytes(b"x" * 10)
    os.chmod(path, 0o666)
    pool = KVCachePool.create_shared(str(path), **LAYOUT)
    try:
        assert _mode(path) == 0o600 and pool.kv.abs().sum().item() == 0
    finally:
        pool.close()


def test_a_link_at_the_path_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep me")
    link = tmp_path / "pool"
    link.symlink_to(target)
    with pytest.raises(OSError):
        KVCachePool.create_shared(str(link), **LAYOUT)
    assert target.read_bytes() == b"keep me"
