"""The RMSNorm and the SiLU·mul that write their output quantized per token (Fp8Rows) for the FP8
projection after them: the same bits as the unfused kernels followed by the quantization kernel,
and the dispatch rule that hands such rows only to routes that would have quantized them.

Small shapes in the Triton interpreter on the CPU; the ``gpu`` test takes llama3-8b's widths."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, gpu, requires_cuda
from kernel_testing import shaped_like as _like

from tandem.kernels import activation, fp8_matmul, ops, reference, rms_norm, skinny_gemm, switches
from tandem.kernels.activation import silu_mul, silu_mul_fp8
from tandem.kernels.fp8_quant import quantize_rows_fp8
from tandem.kernels.fp8_weight import FP8_DTYPE, Fp8Rows, Fp8Weight
from tandem.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_fp8


def _same_rows(fused: Fp8Rows, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    assert fused.dtype == dtype and fused.codes.dtype == FP8_DTYPE and fused.scale.shape == scale.shape
    assert torch.equal(fused.scale, scale)
    assert torch.equal(fused.codes.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden, with_residual", [(64, True), (96, False), (200, True)])
def test_norm_fp8_is_the_norm_then_its_quantization(dtype, hidden, with_residual):
    x = torch.randn(5, hidden, dtype=dtype, device=DEVICE) * 3
    x[2] = 0  # a row of zeros: scale 1
    residual = torch.randn_like(x) if with_residual else None
    if with_residual:
        residual[2] = 0
    weight = torch.rand(hidden, dtype=dtype, device=DEVICE) + 0.5
    normed, h = fused_add_rms_norm(x, residual, weight, 1e-5)
    codes, scale = quantize_rows_fp8(normed)
    rows, h_fused = fused_add_rms_norm_fp8(x, residual, weight, 1e-5)
    _same_rows(rows, codes, scale, dtype)
    assert torch.equal(h_fused, h)
    assert scale[2].item() == 1.0
    # against the torch reference: the same rows up to the norm's own rounding
    ref_rows, ref_h = reference.fused_add_rms_norm_fp8(x, residual, weight, 1e-5)
    torch.testing.assert_close(h_fused, ref_h)
    torch.testing.assert_close(rows.codes.float() * rows.scale, ref_rows.codes.float() * ref_rows.scale,
                               atol=0.05, rtol=0.13)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [48, 160, 4100])  # 4100: two column blocks per pass
def test_silu_mul_fp8_is_silu_mul_then_its_quantization(dtype, inter):
    x = torch.randn(3, 2 * inter, dtype=dtype, device=DEVICE) * 4
    x[1, :inter] = 0  # gate 0: a row of zeros
    codes, scale = quantize_rows_fp8(silu_mul(x))
    _same_rows(silu_mul_fp8(x), codes, scale, dtype)
    ref = reference.silu_mul_fp8(x)
    fused = silu_mul_fp8(x)
    # against the torch reference: a value the two SiLUs round apart may land one E4M3 step apart
    torch.testing.assert_close(fused.codes.float() * fused.scale, ref.codes.float() * ref.scale, atol=0.05, rtol=0.13)


def test_fp8_rows_read_as_the_activations_they_stand_for():
    rows = Fp8Rows(torch.zeros(4, 32, dtype=FP8_DTYPE), torch.ones(4, 1), torch.bfloat16)
    assert rows.shape == (4, 32) and rows.dim() == 2 and rows.stride(1) == 1 and rows.stride() == (32, 1)
    assert rows.dtype == torch.bfloat16 and not rows.is_cuda and rows.device.type == "cpu"


@pytest.fixture
def fp8_routes(monkeypatch):
    """The dispatch rules as on a GPU with FP8 tensor cores (the rules read shapes only)."""
    for name in ("TANDEM_GEMV", "TANDEM_FUSED_FP8_QUANT", "TANDEM_FP8_SKINNY_MAX_ROWS",
                 "TANDEM_FP8_TENSOR_SKINNY_MAX_ROWS"):
        monkeypatch.delenv(name, raising=False)
    switches.reload()
    monkeypatch.setattr(fp8_matmul, "takes", lambda x, weight: True)
    yield monkeypatch
    switches.reload()


def test_quantized_rows_only_where_every_route_quantizes(fp8_routes):
    w = Fp8Weight(_like((64, 64), dtype=FP8_DTYPE), _like((64,), dtype=torch.float32))
    assert not ops.quantizes_input(_like((1, 64)), w)  # one row: the GEMV reads the rows as they are
    assert ops.quantizes_input(_like((2, 64)), w)  # the tensor-core skinny GEMM
    assert ops.quantizes_input(_like((256, 64)), w)  # torch's scaled matmul
    assert not ops.quantizes_input(_like((256, 64)), torch.empty(64, 64))  # not an FP8 weight
    fp8_routes.setenv("TANDEM_FP8_SKINNY_MAX_ROWS", "48")  # the weight-only skinny GEMM up to 48 rows
    switches.reload()
    # 40 rows: linear's rule (32 rows for this shape) takes tensor cores, gate_up_silu_mul's (64) the
    # weight-only GEMM, which reads the model's dtype: not quantized
    assert ops._triton_matmul(_like((40, 64)), w, None) is None
    assert ops._triton_matmul(_like((40, 64)), w, None, ops.SKINNY_SILU_MUL_MAX_ROWS) == "skinny"
    assert not ops.quantizes_input(_like((40, 64)), w)
    assert ops.quantizes_input(_like((49, 64)), w)
    fp8_routes.setenv("TANDEM_FUSED_FP8_QUANT", "0")
    switches.reload()
    assert not ops.quantizes_input(_like((256, 64)), w)


def test_quantized_rows_never_reach_a_route_that_reads_the_model_dtype():
    rows = Fp8Rows(torch.zeros(4, 32, dtype=FP8_DTYPE), torch.ones(4, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="already quantized"):
        ops.linear(rows, torch.randn(16, 32, dtype=torch.bfloat16))


@gpu
@requires_cuda
@pytest.mark.parametrize("rows", [256, 1024])
def test_gpu_fused_quantization_at_llama3_8b_widths(rows):
    x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.rand(4096, dtype=torch.bfloat16, device="cuda") + 0.5
    normed, h = fused_add_rms_norm(x, residual, weight, 1e-5)
    fused, h_fused = fused_add_rms_norm_fp8(x, residual, weight, 1e-5)
    _same_rows(fused, *quantize_rows_fp8(normed), torch.bfloat16)
    assert torch.equal(h, h_fused)
    gate_up = torch.randn(rows, 2 * 14336, dtype=torch.bfloat16, device="cuda")
    _same_rows(silu_mul_fp8(gate_up), *quantize_rows_fp8(silu_mul(gate_up)), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("rows", [8, 64])
def test_gpu_add_norm_finish_fp8_at_llama3_8b_widths(rows):
    from tandem.kernels.fp8_weight import quantize_weight

    sg = skinny_gemm

    x = torch.randn(rows, 14336, dtype=torch.bfloat16, device="cuda")
    w = quantize_weight(torch.randn(4096, 14336, device="cuda") / 120)
    residual = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    norm_w = torch.rand(4096, dtype=torch.bfloat16, device="cuda") + 0.5
    x_q, x_scale = quantize_rows_fp8(x)
    normed, h = sg.skinny_linear_add_rms_norm(x_q, w, residual, norm_w, 1e-5, x_scale=x_scale)
    rows_fp8, h8 = sg.skinny_linear_add_rms_norm(x_q, w, residual, norm_w, 1e-5, x_scale=x_scale, fp8_out=True)
    _same_rows(rows_fp8, *quantize_rows_fp8(normed), torch.bfloat16)
    assert torch.equal(h, h8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, N, K, config", [(2, 37, 200, None), (17, 64, 96, (16, 32, 4, 3, 2))])
def test_add_norm_finish_fp8_is_the_finish_then_its_quantization(dtype, M, N, K, config):
    """The skinny GEMM's add-norm finish (2-64 rows) writing Fp8Rows: its own output, quantized."""
    sg = skinny_gemm
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) / K**0.5).to(dtype)
    residual = torch.randn(M, N, device=DEVICE).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(N, device=DEVICE)).to(dtype)
    y, h = torch.empty(M, N, dtype=dtype, device=DEVICE), torch.empty(M, N, dtype=dtype, device=DEVICE)
    sg._launch_skinny(x, w, None, y, silu_mul=False, config=config, add_norm=sg.AddNorm(residual, norm_w, 1e-5, h))
    codes, scale = quantize_rows_fp8(y)
    y8, h8 = torch.empty(M, N, dtype=FP8_DTYPE, device=DEVICE), torch.empty_like(h)
    scale8 = torch.empty(M, 1, dtype=torch.float32, device=DEVICE)
    sg._launch_skinny(x, w, None, y8, silu_mul=False, config=config,
                      add_norm=sg.AddNorm(residual, norm_w, 1e-5, h8, scale8))
    _same_rows(Fp8Rows(y8, scale8, dtype), codes, scale, dtype)
    assert torch.equal(h8, h)
    normed, h_rule = sg.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-5)  # the tile rule's splits
    rows, h_out = sg.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-5, fp8_out=True)
    assert isinstance(rows, Fp8Rows) and torch.equal(h_out, h_rule)
    _same_rows(rows, *quantize_rows_fp8(normed), dtype)


def test_a_forward_through_the_kernels_gives_the_same_logits_fused_or_not(monkeypatch):
    """A tiny FP8 model's forward with every op on its Triton kernel (interpreted here, as the GPU
    runs them: the tensor-core skinny GEMM and its add-norm finish from 2 to 64 rows, the norm and
    SiLU·mul past them), the projections' inputs quantized by the kernels before them or by a pass
    of their own: the same logits, bit for bit. torch's scaled matmul (cuBLASLt) is the one piece
    stood in: the codes times their scales, in fp32."""
    from tandem.engine.attention import SeqChunk
    from tandem.engine.config import ModelConfig
    from tandem.engine.loader import random_model
    from tandem.engine.runner import ModelRunner
    from tandem.kernels.fp8_weight import dequantize

    if torch.cuda.is_available():
        pytest.skip("the CPU's interpreted kernels (the GPU runs the real ones in the gpu tests)")
    monkeypatch.setattr(ops, "_pick", lambda name, tensor: ops._triton_impl(name) or getattr(reference, name))
    monkeypatch.setattr(ops, "_triton_layout", lambda x, weight, bias: x.dim() == 2 and x.stride(1) == 1)
    monkeypatch.setattr(fp8_matmul, "takes", lambda x, weight: x.dtype == torch.bfloat16 and weight.shape[1] % 16 == 0)
    monkeypatch.setattr(fp8_matmul, "scaled_mm", lambda x_q, x_scale, weight, bias, out_dtype: (
        (x_q.float() * x_scale) @ dequantize(weight).T).to(out_dtype))
    calls = {"fused_add_rms_norm_fp8": 0, "silu_mul_fp8": 0, "skinny_fp8_out": 0, "kept": 0}
    for module, name in ((rms_norm, "fused_add_rms_norm_fp8"), (activation, "silu_mul_fp8")):
        monkeypatch.setattr(module, name, _counting(getattr(module, name), calls, name))
    finish = skinny_gemm.skinny_linear_add_rms_norm

    def counted_finish(*args, fp8_out=False, **kwargs):
        calls["skinny_fp8_out"] += fp8_out
        return finish(*args, fp8_out=fp8_out, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_linear_add_rms_norm", counted_finish)
    ops._triton_impl.cache_clear()  # it keeps the functions it found: these wrappers now
    config = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5))
    model = random_model(config, torch.bfloat16, "cpu", seed=3, quantization="fp8")
    runner = ModelRunner.from_model(model, config, num_blocks=24, block_size=16)
    steps = [
        [SeqChunk(list(range(3, 133)), 0, list(range(9)))],  # 130 rows: the norm, SiLU·mul and scaled matmul
        [SeqChunk(list(range(5, 25)), 0, [10, 11]), SeqChunk(list(range(40, 47)), 0, [12])],  # 27: the skinny GEMM
    ]
    try:
        for chunks in steps:
            logits = {}
            for fused in (False, True):
                monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "1" if fused else "0")
                switches.reload()
                logits[fused] = runner.forward(chunks)
            assert torch.equal(logits[True], logits[False])
        layers = len(model.layers)
        # 130 rows: every layer's two norms (the last one's second excepted, the first norm counted);
        # 27 rows: the skinny finish after o and down (the last down's excepted), the first norm
        assert calls == {"fused_add_rms_norm_fp8": 2 * layers + 1, "silu_mul_fp8": layers,
                         "skinny_fp8_out": 2 * layers - 1, "kept": 0}
        # a step with adapter rows, A stacks apart from the weights: the norms and the SiLU·mul keep
        # their values for the adapters' shrinks (fused, a projection's shrink reads the codes)
        lora = runner.enable_lora(max_loras=2, max_rank=8, fuse=False)
        with lora.weights.zero_adapter(1):
            _random_adapter(lora.weights, 1)
            chunks = [SeqChunk(list(range(5, 25)), 0, [10, 11], lora_slot=1), SeqChunk(list(range(40, 47)), 0, [12])]
            logits = _fused_and_apart(runner, chunks, calls, monkeypatch)
            assert torch.equal(logits[True], logits[False])
            # every norm (no skinny finish: the adapters add to o's and down's outputs before their
            # norms) and every SiLU·mul, their values kept
            assert calls["fused_add_rms_norm_fp8"] == 2 * layers and calls["silu_mul_fp8"] == layers
            assert calls["kept"] == 3 * layers
            base = runner.forward([SeqChunk(list(range(5, 25)), 0, [10, 11])])
            assert not torch.equal(base[0], logits[True][0])  # the adapter moved its row
        apart = logits[True]
        # the same adapter with every A stack under its FP8 weight (LoraWeights.fuse_into): the shrinks
        # in the FP8 matmuls, gate/up's LoRA in the SiLU·mul, no values kept; the same logits either way
        # of the switch, and near the apart stacks' (A and x in E4M3 for the shrinks)
        runner = ModelRunner.from_model(random_model(config, torch.bfloat16, "cpu", seed=3, quantization="fp8"),
                                        config, num_blocks=24, block_size=16)
        lora = runner.enable_lora(max_loras=2, max_rank=8, fuse=True)
        assert all(stack.weight is not None for layer in lora.weights.layers for stack in layer.values())
        with lora.weights.zero_adapter(1):
            _random_adapter(lora.weights, 1)
            logits = _fused_and_apart(runner, chunks, calls, monkeypatch)
            assert torch.equal(logits[True], logits[False])
            assert calls["kept"] == 0 and calls["silu_mul_fp8"] == layers
            effect = (apart - base).abs().max()
            assert (logits[True] - apart).abs().max() < 0.1 * effect
    finally:
        ops._triton_impl.cache_clear()
        switches.reload()


def _random_adapter(weights, slot):
    """Slot ``slot`` (inside ``zero_adapter``) filled with a seeded random adapter on every projection."""
    generator = torch.Generator().manual_seed(5)
    for layer in weights.layers:
        for stack in layer.values():
            stack.a[slot].normal_(0, 0.1, generator=generator)
            stack.b_all[slot].normal_(0, 0.1, generator=generator)
            stack.scales[:, slot] = 0.5
    weights.sync_fused(slot)


def _fused_and_apart(runner, chunks, calls, monkeypatch) -> dict:
    """The step's logits with the quantization apart (False) and fused (True); ``calls`` counts the second."""
    logits = {}
    for fused in (False, True):
        monkeypatch.setenv("TANDEM_FUSED_FP8_QUANT", "1" if fused else "0")
        switches.reload()
        calls.update({name: 0 for name in calls})
        logits[fused] = runner.forward(chunks)
    return logits


def _counting(op, calls, name):
    def counted(*args, **kwargs):
        calls[name] += 1
        rows = op(*args, **kwargs)
        calls["kept"] += (rows if isinstance(rows, Fp8Rows) else rows[0]).values is not None
        return rows
    return counted
