"""--kv-cache-dtype: the flag on every worker's command line, and KV pool sizing by bytes."""

import argparse

import pytest
import torch

from tandem.cluster.settings import CPU_DEFAULT_KV_TOKENS, Settings, SettingsError, add_arguments
from tandem.engine.kv_cache import resolve_kv_dtype
from tandem.engine.runner_factory import kv_pool_blocks
from tandem.launcher import service_argv


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tandem.engine.demo_model import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("m"))


def test_the_flag_reaches_every_worker(model_dir, monkeypatch):
    for name in ("TANDEM_ADMIN_TOKEN", "TANDEM_API_KEY", "TANDEM_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever service_argv sets
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(["--model", model_dir, "--kv-cache-dtype", "fp8"])).resolve()
    assert settings.kv_cache_dtype == "fp8" and Settings().kv_cache_dtype == "auto"
    for role in ("prefill", "decode"):
        argv = service_argv(role, settings)
        assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    with pytest.raises(SettingsError, match="--kv-cache-dtype must be one of"):
        Settings(model=model_dir, kv_cache_dtype="int8").resolve()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp16"])


def test_auto_is_the_model_dtype():
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="auto"):
        resolve_kv_dtype("e5m2", torch.float32)


def test_a_token_budget_is_bytes_at_the_model_dtype():
    """--max-tokens-in-paged-kv-cache and the CPU default are memory: FP8 holds 2x a bf16 model's
    tokens in them (4x an fp32 model's)."""
    cpu, block = torch.device("cpu"), 16
    bf16, fp8 = 2 * 1024, 1024  # bytes per token of one model's cache in bf16 and in E4M3
    settings = Settings(tokens_per_block=block, max_tokens_in_paged_kv_cache=4096)
    assert kv_pool_blocks(settings, bf16, cpu) == 256
    assert kv_pool_blocks(settings, fp8, cpu, budget_bytes_per_token=bf16) == 512
    assert kv_pool_blocks(settings, fp8, cpu, budget_bytes_per_token=4 * fp8) == 1024
    default = Settings(tokens_per_block=block)
    assert kv_pool_blocks(default, fp8, cpu, budget_bytes_per_token=bf16) == 2 * CPU_DEFAULT_KV_TOKENS // block


def test_the_gpu_fraction_holds_twice_the_fp8_tokens(monkeypatch):
    free = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    gpu, block = torch.device("cuda"), 16
    settings = Settings(tokens_per_block=block, kv_cache_free_gpu_mem_fraction=0.5)
    bf16_blocks = kv_pool_blocks(settings, 2048, gpu)
    assert kv_pool_blocks(settings, 1024, gpu, budget_bytes_per_token=2048) == 2 * bf16_blocks
    # the prefill worker's default cap is the tokens it needs, not a budget: the same count either way
    assert kv_pool_blocks(settings, 1024, gpu, gpu_cap_tokens=1600, budget_bytes_per_token=2048) == 100
