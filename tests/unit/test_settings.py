"""Start-up validation of the limits and KV pool sizing."""

import subprocess
import sys

import pytest
import torch

from cluster.settings import CPU_DEFAULT_KV_TOKENS, Settings, SettingsError
from engine.placement import kv_pool_blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.testing import make_tiny_checkpoint

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
        [sys.executable, "-m", "cluster.cli", "decode", "--model", model_dir, "--kv-cache-free-gpu-mem-fraction", "1.0"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "kv-cache-free-gpu-mem-fraction must be in (0, 1)" in result.stderr


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
