"""The decode worker's shared-memory KV pool file: a run killed before its clean stop, or a
start that fails, must not leave its RAM in /dev/shm for good."""

import os
import stat
import subprocess
import sys
import tempfile

import pytest
import redis

from tandem.redis_server import free_port
from tandem.cluster.settings import Settings
from tandem.decode import worker as decode_worker
from tandem.kvtransfer.pool_files import pool_dir, remove_stale_pool_files


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_files_of_this_worker_go_and_nothing_else(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    for name in (f"tandem-kv-decode-0-{dead}", f"tandem-kv-decode-0-{alive}", f"tandem-kv-decode-1-{dead}",
                 "tandem-kv-decode-0-notapid", "unrelated"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_pool_files(str(tmp_path), "tandem-kv-decode-0-")
    assert removed == [str(tmp_path / f"tandem-kv-decode-0-{dead}")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"tandem-kv-decode-0-{alive}", f"tandem-kv-decode-1-{dead}", "tandem-kv-decode-0-notapid", "unrelated"])


def test_a_decode_worker_that_fails_to_start_leaves_no_pool_file(tmp_path, monkeypatch):
    from tandem.engine.demo_model import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m", "llama")
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / f"tandem-kv-decode-t-{_dead_pid()}").write_bytes(b"x")  # an earlier run, SIGKILLed
    monkeypatch.setattr(decode_worker, "pool_dir", lambda configured: str(shm))
    settings = Settings(model=model, redis_url=f"redis://127.0.0.1:{free_port()}/0", device="cpu",
                        worker_id="decode-t", max_tokens_in_paged_kv_cache=512, max_seq_len=256,
                        kv_transport="shm").resolve()
    with pytest.raises(redis.ConnectionError):  # nothing listens there: the start fails after the pool exists
        decode_worker.DecodeWorker(settings)
    assert list(shm.iterdir()) == []


def test_the_pool_directory_is_shm_dir_where_set(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_SHM_DIR", raising=False)
    assert pool_dir(Settings.field_default("shm_dir")) == (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    monkeypatch.setenv("TANDEM_SHM_DIR", str(tmp_path / "pools"))  # --shm-dir's variable
    assert pool_dir(Settings.field_default("shm_dir")) == str(tmp_path / "pools")
    assert stat.S_IMODE(os.stat(tmp_path / "pools").st_mode) == 0o700  # made, open to its user only
