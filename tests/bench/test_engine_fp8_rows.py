"""`tandem bench engine --quantization fp8`: the flag, and the bytes its FP8 rows' bandwidth floor
counts (E4M3 rows and their fp32 scales, the rest in the model dtype), on the CPU at a tiny shape."""

import torch

from tandem.bench.engine import weight_bytes
from tandem.cli import build_parser
from tandem.engine.config import ModelConfig
from tandem.engine.loader import random_model
from tandem.engine.runner import ModelRunner

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            rms_norm_eps=1e-5)


def test_the_flag_is_taken():
    args = build_parser().parse_args(["bench", "engine", "--quantization", "fp8"])
    assert args.quantization == "fp8"
    assert build_parser().parse_args(["bench", "engine"]).quantization == "none"


def test_fp8_weight_bytes_are_the_rows_at_one_byte_plus_their_scales():
    sizes = {}
    for quantization in (None, "fp8"):
        config = ModelConfig.from_dict(TINY)
        model = random_model(config, torch.bfloat16, "cpu", quantization=quantization)
        sizes[quantization] = weight_bytes(ModelRunner.from_model(model, config, num_blocks=4, block_size=16))
    h, i, layers = 64, 128, 2
    rows = (64 + 2 * 32) + h + 2 * i + h  # qkv, o, gate/up, down output rows of a layer
    elements = layers * (h * (64 + 2 * 32) + 64 * h + h * 2 * i + i * h)
    assert sizes[None] - sizes["fp8"] == elements * 2 - (elements + layers * rows * 4)
    model = random_model(ModelConfig.from_dict(TINY), torch.bfloat16, "cpu", quantization="fp8")
    assert model.layers[1].down_proj.weight.dtype == torch.float8_e4m3fn
    assert model.embed_tokens.weight.dtype == model.lm_head.dtype == torch.bfloat16
