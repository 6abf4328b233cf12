"""A forward of an FP8 model whose norms and SiLU·mul hand their FP8 projections quantized rows
(kernels.ops.quantize_for) gives the same logits, bit for bit, as one whose projections quantize
their input themselves (TANDEM_FUSED_FP8_QUANT=0).

On the CPU the FP8 projections dequantize their weights and never quantize their input, so the
test stands in the FP8 tensor-core route's two GPU-only pieces: ``fp8_matmul.takes`` says yes for
CPU bf16 rows, and ``fp8_matmul.scaled_mm`` multiplies the codes as the tensor cores would (in
fp32). Everything else (the dispatch rules, the model's wiring, the torch references of the fused
ops) is the code the GPU runs."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.config import ModelConfig
from tandem.engine.loader import random_model
from tandem.engine.runner import ModelRunner
from tandem.kernels import fp8_matmul, reference, switches
from tandem.kernels.fp8_weight import dequantize

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
            rms_norm_eps=1e-5)


def _takes(x, weight) -> bool:  # fp8_matmul.takes without its device checks
    num_out, K = weight.shape
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] == K and K % 16 == 0 \
        and num_out % 16 == 0


def _scaled_mm(x_q, x_scale, weight, bias, out_dtype):
    y = (x_q.float() * x_scale) @ dequantize(weight).T
    return (y if bias is None else y + bias.float()).to(out_dtype)


@pytest.fixture
def counted(monkeypatch):
    """FP8 tensor-core routes on the CPU; -> calls of the fused ops by name."""
    monkeypatch.setattr(fp8_matmul, "takes", _takes)
    monkeypatch.setattr(fp8_matmul, "scaled_mm", _scaled_mm)
    calls = {"fused_add_rms_norm_fp8": 0, "silu_mul_fp8": 0}
    for name in calls:
        op = getattr(reference, name)

        def wrapped(*args, _op=op, _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(reference, name, wrapped)
    yield calls
    switches.reload()


def _logits(runner, chunks, monkeypatch, fused: bool) -> torch.Tensor:
    monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "1" if fused else "0")
    switches.reload()
    return runner.forward(chunks)


def test_fused_quantization_gives_the_same_logits(counted, monkeypatch):
    torch.manual_seed(0)
    config = ModelConfig.from_dict(TINY)
    model = random_model(config, torch.bfloat16, "cpu", seed=1, quantization="fp8")
    runner = ModelRunner.from_model(model, config, num_blocks=8, block_size=16)
    prompts = [SeqChunk(list(range(3, 23)), 0, [0, 1]), SeqChunk(list(range(40, 47)), 0, [2])]
    decode = [SeqChunk([5], 20, [0, 1]), SeqChunk([9], 7, [2])]
    for chunks in (prompts, decode):
        unfused = _logits(runner, chunks, monkeypatch, fused=False)
        assert counted == {"fused_add_rms_norm_fp8": 0, "silu_mul_fp8": 0}
        fused = _logits(runner, chunks, monkeypatch, fused=True)
        layers = len(model.layers)
        # each layer's norm after o_proj, the norm before each qkv (the first one's included), each SiLU·mul
        assert counted == {"fused_add_rms_norm_fp8": 2 * layers, "silu_mul_fp8": layers}
        assert torch.equal(fused, unfused)
        counted.update({name: 0 for name in counted})


def test_only_a_split_model_keeps_every_norm_in_the_model_dtype():
    """The final norm's output (the logits' input) is never quantized; a model split over ranks
    quantizes none of its norms' outputs (they follow collectives)."""
    config = ModelConfig.from_dict(TINY)
    model = random_model(config, torch.bfloat16, "cpu", seed=1, quantization="fp8")
    layers = len(model.layers)
    assert [w is None for w in model.qkv_weights()] == [False] * layers + [True]
    model.layers[0].tp = object()
    assert model.qkv_weights() == [None] * (layers + 1)
