"""`tandem bench engine --kv-cache-dtype fp8`: the flag, and the KV bytes its _fp8kv rows' bandwidth
floor counts (one byte an element), on the CPU at a tiny shape."""

import torch

from tandem.cli import build_parser
from tandem.engine.config import ModelConfig
from tandem.engine.loader import random_model
from tandem.engine.runner import ModelRunner

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            rms_norm_eps=1e-5)


def test_the_flag_is_taken():
    assert build_parser().parse_args(["bench", "engine", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert build_parser().parse_args(["bench", "engine"]).kv_cache_dtype == "auto"


def test_an_fp8_pool_reads_half_a_bf16_pools_bytes():
    """What decode_workload counts: kv_bytes_per_token of the runner's pool dtype."""
    config = ModelConfig.from_dict(TINY)
    model = random_model(config, torch.bfloat16, "cpu")
    runners = {d: ModelRunner.from_model(model, config, num_blocks=4, block_size=16, kv_cache_dtype=d)
               for d in ("auto", "fp8")}
    per_token = {d: config.kv_bytes_per_token(r.kv_pool.dtype) for d, r in runners.items()}
    assert per_token["auto"] == 2 * per_token["fp8"] == 2 * 2 * 2 * 2 * 16
    assert runners["fp8"].kv_pool.bytes_per_block * 2 == runners["auto"].kv_pool.bytes_per_block
