"""Start-up validation of the limits and KV pool sizing."""

import subprocess
import sys

import pytest
import torch

from tandem.redis_server import free_port
from tandem.cluster.settings import CPU_DEFAULT_KV_TOKENS, Settings, SettingsError
from tandem.engine.runner_factory import kv_pool_blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tandem.engine.demo_model import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("m"))  # max_position_embeddings 512


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(kv_cache_free_gpu_mem_fraction=1.0), "kv-cache-free-gpu-mem-fraction"),
        (dict(kv_cache_free_gpu_mem_fraction=0.0), "kv-cache-free-gpu-mem-fraction"),
        (dict(kv_cache_free_gpu_mem_fraction=1.5), "kv-cache-free-gpu-mem-fraction"),
        (dict(max_seq_len=4096), "max_position_embeddings"),
        (dict(max_seq_len=256, max_input_len=256), "max-input-len"),
        (dict(tokens_per_block=12), "power of two"),
        (dict(tokens_per_block=16, max_num_tokens=8), "max-num-tokens"),
        (dict(max_seq_len=256, max_tokens_in_paged_kv_cache=128), "max-tokens-in-paged-kv-cache"),
        (dict(max_batch_size=0), "max-batch-size"),
        (dict(decode_batch_wait_ms=-5), "decode-batch-wait-ms"),
        (dict(port=99999), "--port"),
        (dict(port=0), "--port"),
        (dict(heartbeat_interval_s=2.0, heartbeat_ttl_s=0.5), "heartbeat-interval-s"),
        (dict(log_level="verbose"), "log-level"),
        (dict(tensor_parallel_size=0), "tensor-parallel-size must be >= 1"),
        (dict(prefill_tp=0), "--prefill-tp must be >= 1"),
        (dict(decode_tp=2, enable_lora=True), "--enable-lora does not run with"),
        (dict(tensor_parallel_size=2, kv_host_cache_gb=1.0), "--kv-host-cache-gb does not run with"),
        (dict(tensor_parallel_size=2, kv_cache_dtype="fp8"), "--kv-cache-dtype fp8 does not run with"),
    ],
)
def test_inconsistent_limits_are_rejected_with_the_flag_named(model_dir, overrides, message):
    with pytest.raises(SettingsError, match=message):
        Settings(model=model_dir, **overrides).resolve()


def test_defaults_follow_the_model(model_dir):
    settings = Settings(model=model_dir).resolve()
    assert (settings.max_seq_len, settings.max_input_len) == (512, 511)


def test_cli_reports_a_bad_flag_and_exits_2(model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "decode", "--model", model_dir, "--kv-cache-free-gpu-mem-fraction", "1.0"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "kv-cache-free-gpu-mem-fraction must be in (0, 1)" in result.stderr


def test_serve_refuses_zero_workers_and_a_port_in_use(model_dir):
    import socket

    zero = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", model_dir,
                           "--num-decode-workers", "0"], capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "must be at least 1" in zero.stderr
    with socket.create_server(("127.0.0.1", 0)) as busy:  # someone else's server on the port
        port = busy.getsockname()[1]
        taken = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", model_dir,
                                "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    assert "serving" not in taken.stdout  # refused before starting anything
    with socket.create_server(("127.0.0.1", 0)) as busy:  # the admin API's port
        port = busy.getsockname()[1]
        taken = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", model_dir,
                                "--port", str(free_port()), "--admin-port", str(port)],
                               capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    same = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", model_dir, "--port", "8123",
                           "--admin-port", "8123"], capture_output=True, text=True, timeout=60)
    assert same.returncode == 2 and "--admin-port must be in [0, 65535]" in same.stderr


def test_serve_refuses_a_checkpoint_without_a_tokenizer_before_loading_weights(model_dir, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{model_dir}/{name}", bare)
    done = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", str(bare)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "cannot load the tokenizer" in done.stderr and "serving" not in done.stdout


def test_a_kv_pool_file_that_does_not_fit_is_refused_at_once(tmp_path, monkeypatch):
    """Not a sparse file that kills the worker with SIGBUS once its pages are touched."""
    import errno
    import os

    from tandem.engine import kv_cache

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room, raising=False)
    path = tmp_path / "pool"
    with pytest.raises(OSError, match="needs .* GiB.*shm_size"):
        kv_cache._create_zeroed_file(str(path), 3 << 30)
    assert not path.exists()


def test_kv_pool_cpu_default_and_token_cap():
    cpu = torch.device("cpu")
    assert kv_pool_blocks(Settings(tokens_per_block=16), 512, cpu) == CPU_DEFAULT_KV_TOKENS // 16
    assert kv_pool_blocks(Settings(tokens_per_block=16, max_tokens_in_paged_kv_cache=1024), 512, cpu) == 64


def test_kv_pool_on_gpu_takes_the_smaller_of_fraction_and_cap(monkeypatch):
    free = 1 << 30  # 1 GiB free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    gpu = torch.device("cuda")
    bytes_per_token, block = 1024, 16
    by_fraction = int(free * 0.5 // (bytes_per_token * block))
    settings = Settings(tokens_per_block=block, kv_cache_free_gpu_mem_fraction=0.5)
    assert kv_pool_blocks(settings, bytes_per_token, gpu) == by_fraction
    settings.max_tokens_in_paged_kv_cache = 160
    assert kv_pool_blocks(settings, bytes_per_token, gpu) == 10  # the cap is smaller
    settings.max_tokens_in_paged_kv_cache = 10**9
    assert kv_pool_blocks(settings, bytes_per_token, gpu) == by_fraction  # the fraction is smaller


def test_quantization_flag_reaches_every_worker(model_dir, monkeypatch):
    """--quantization: none (default) or fp8, checked at resolve, on every worker's command line."""
    import argparse

    from tandem.cluster.settings import add_arguments
    from tandem.launcher import service_argv

    for name in ("TANDEM_ADMIN_TOKEN", "TANDEM_API_KEY", "TANDEM_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever service_argv sets
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(["--model", model_dir, "--quantization", "fp8"])).resolve()
    assert settings.quantization == "fp8" and Settings().quantization == "none"
    for role in ("prefill", "decode"):
        argv = service_argv(role, settings)
        assert argv[argv.index("--quantization") + 1] == "fp8"
    with pytest.raises(SettingsError, match="--quantization must be one of"):
        Settings(model=model_dir, quantization="int4").resolve()
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
