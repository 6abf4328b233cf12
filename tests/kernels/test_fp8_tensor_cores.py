"""FP8 activations and weights on FP8 tensor cores: the skinny GEMM's tensor-core form (x quantized
per token, kernels.skinny_gemm X_SCALED), its tile rule and dispatch, and torch's scaled matmul,
against the references on the same codes (the product of both operands' values, fp32-accumulated).
Small shapes run in the Triton interpreter on the CPU; the ``gpu`` tests take real projection shapes.
"""

import pytest
import torch
from kernel_testing import DEVICE, assert_close, gpu, poisoned, requires_cuda
from kernel_testing import random_fp8 as _fp8
from kernel_testing import shaped_like as _like

from tandem.kernels import ops, reference
from tandem.kernels.fp8_quant import quantize_rows_fp8
from tandem.kernels.fp8_weight import FP8_DTYPE, Fp8Weight
from tandem.kernels.skinny_gemm import _launch_skinny, skinny_linear, skinny_linear_add_rms_norm, skinny_silu_mul
from tandem.kernels import switches


def _quantized(M, K):
    x = torch.randn(M, K, device=DEVICE) * torch.logspace(-1, 1, M, device=DEVICE)[:, None]
    x_q, x_scale = reference.quantize_rows_fp8(x)
    return x_q, x_scale.contiguous(), x_q.float() * x_scale  # the codes, their scales, what they stand for


@pytest.mark.parametrize("M, N, K", [(2, 37, 64), (17, 40, 224), (64, 96, 96)])
def test_skinny_fp8_activations_match_reference(M, N, K):
    """E4M3 x (per-token scales) times E4M3 W (per-row scales): the product of both operands'
    values, fp32-accumulated: linear with a bias, gate/up with SiLU·mul, and the add-norm finish."""
    x_q, x_scale, x_values = _quantized(M, K)
    w, b = _fp8(N, K), torch.randn(N, device=DEVICE)
    out = skinny_linear(x_q, w, b, x_scale=x_scale, out_dtype=torch.float32)
    assert out.shape == (M, N) and out.dtype == torch.float32
    assert_close(out, reference.gemv(x_values, w, b), torch.float32)
    g = _fp8(2 * N, K, scale=2.0)
    assert_close(skinny_silu_mul(x_q, g, x_scale=x_scale, out_dtype=torch.bfloat16),
                 reference.gemv_silu_mul(x_values, g), torch.bfloat16)
    residual, norm_weight = torch.randn(M, N, device=DEVICE).bfloat16(), torch.rand(N, device=DEVICE) + 0.5
    out, h = skinny_linear_add_rms_norm(x_q, w, residual, norm_weight, 1e-6, x_scale=x_scale)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x_values.bfloat16(), w, residual, norm_weight, 1e-6)
    assert out.dtype == h.dtype == torch.bfloat16
    assert_close(h, ref_h, torch.bfloat16, scale=2.0)  # x's bf16 rounding in the reference, not the kernel
    assert_close(out, ref_out, torch.bfloat16, scale=2.0)


@pytest.mark.parametrize("config", [(16, 32, 4, 2, 1), (32, 64, 4, 3, 2), (16, 32, 4, 3, 3)])
def test_skinny_fp8_activations_split_k(config):
    x_q, x_scale, x_values = _quantized(17, 224)
    w, b = _fp8(41, 224), torch.randn(41, device=DEVICE)
    y = poisoned((17, 41), torch.float32)
    _launch_skinny(x_q, w, b, y, silu_mul=False, config=config, x_scale=x_scale)
    assert_close(y, reference.gemv(x_values, w, b), torch.float32)


def test_fp8_tile_rule_fits_shared_memory_and_splits_within_one_wave():
    """The tensor-core skinny rule at llama-family shapes, 2 to 128 rows: its stages (plus the peeled
    first tile) fit the 220 KB it budgets, K tiles fill every split's stages, and no split grid
    exceeds one program per SM."""
    from tandem.kernels.skinny_tiles import _SMEM_BYTES, fp8_tile_config

    for M in (2, 16, 17, 64, 128):
        for N, K, silu in [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False),
                           (3072, 2048, False), (16384, 2048, True)]:
            block_n, block_k, warps, stages, split = fp8_tile_config(M, N, K, silu, sms=132)
            block_m = max(16, 1 << (M - 1).bit_length())
            stage = ((2 if silu else 1) * block_n + block_m) * block_k
            assert (stages + 1) * stage <= _SMEM_BYTES and stages >= 2 and warps == 4
            programs = -(-(N // 2 if silu else N) // block_n)
            assert split == 1 or (programs * split <= 132 and K // block_k >= split * stages)


def test_skinny_fp8_activations_are_checked():
    x_q, x_scale, _ = _quantized(4, 64)
    with pytest.raises(AssertionError, match="FP8 activations take an FP8 weight"):
        skinny_linear(x_q, torch.randn(8, 64, device=DEVICE), x_scale=x_scale)
    with pytest.raises(AssertionError):
        skinny_linear(x_q, _fp8(8, 64), x_scale=x_scale[:2])


def test_dispatch_sends_fp8_weights_past_the_weight_only_rows_to_tensor_cores(monkeypatch):
    """Past fp8_skinny_max_rows(): the skinny GEMM on FP8 tensor cores up to
    fp8_tensor_skinny_max_rows() (K a multiple of 32), torch's scaled matmul past them."""
    from tandem.kernels import fp8_matmul

    monkeypatch.delenv("TANDEM_GEMV", raising=False)
    switches.reload()
    monkeypatch.setattr(fp8_matmul, "takes", lambda x, weight: True)
    w = Fp8Weight(_like((12, 64), dtype=FP8_DTYPE), _like((12,), dtype=torch.float32))
    kind = ops._triton_matmul
    for env in ("TANDEM_FP8_SKINNY_MAX_ROWS", "TANDEM_FP8_TENSOR_SKINNY_MAX_ROWS"):
        monkeypatch.delenv(env, raising=False)
        switches.reload()
    assert kind(_like((1, 64)), w, None) == "gemv"  # the rule: the GEMV, then tensor cores from 2 rows to 128
    assert kind(_like((2, 64)), w, None) == "skinny_fp8"
    assert kind(_like((128, 64)), w, None) == "skinny_fp8"
    assert kind(_like((129, 64)), w, None) is None
    monkeypatch.setenv("TANDEM_FP8_SKINNY_MAX_ROWS", "8")
    switches.reload()
    monkeypatch.setenv("TANDEM_FP8_TENSOR_SKINNY_MAX_ROWS", "64")
    switches.reload()
    assert kind(_like((8, 64)), w, None) == "skinny"
    assert kind(_like((9, 64)), w, None) == "skinny_fp8"
    assert kind(_like((64, 64)), w, None) == "skinny_fp8"
    assert kind(_like((65, 64)), w, None) is None
    w48 = Fp8Weight(_like((12, 48), dtype=FP8_DTYPE), w.scale)
    assert kind(_like((9, 48)), w48, None) is None  # K not a multiple of the FP8 MMA's 32
    monkeypatch.setenv("TANDEM_FP8_TENSOR_SKINNY_MAX_ROWS", "0")
    switches.reload()
    assert kind(_like((9, 64)), w, None) is None


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [17, 32, 64, 128])
@pytest.mark.parametrize("N, K, silu", [(6144, 4096, False), (4096, 14336, False), (28672, 4096, True)])
def test_gpu_skinny_fp8_activations_real_shapes(M, N, K, silu):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x_q, x_scale = quantize_rows_fp8(x)
    w = _fp8(N, K, scale=2.0, device="cuda")
    y = poisoned((M, N // 2 if silu else N), torch.bfloat16, "cuda")
    _launch_skinny(x_q, w, None, y, silu, x_scale=x_scale)
    ref = (reference.gemv_silu_mul if silu else reference.gemv)(x_q.float() * x_scale, w)
    assert_close(y, ref, torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [65, 128, 2048])
@pytest.mark.parametrize("N, K", [(12288, 4096), (4096, 4096), (4096, 14336), (28672, 4096)])
def test_gpu_scaled_mm_matches_the_reference_on_the_quantized_activations(M, N, K):
    """torch._scaled_mm with per-token x scales and per-channel weight scales: the product of the
    two FP8 operands, fp32-accumulated, as the reference computes it from their dequantized values."""
    from tandem.kernels import fp8_matmul

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = _fp8(N, K, device="cuda")
    assert fp8_matmul.takes(x, w)
    x_q, x_scale = ops.quantize_rows_fp8(x)
    y = fp8_matmul.scaled_mm(x_q, x_scale, w, None, torch.bfloat16)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert_close(y, reference.gemv(x_q.float() * x_scale, w), torch.bfloat16)


def test_skinny_fp8_add_norm_finish_adds_a_fused_weights_lora():
    """An FP8 weight whose rows past N are every slot's A, quantized per row like the projection's
    (engine.lora_weights.fuse_into on an FP8 model), on FP8 activations: the finish adds each adapter
    row's LoRA from the product's extra columns before the residual, as the reference does on the same
    codes; rows of no adapter are the plain finish's."""
    from tandem.kernels.fp8_weight import quantize_weight
    from tandem.kernels.lora_rows import LoraRows

    M, N, K, slots, rank = 6, 40, 96, 3, 16
    x_q, x_scale, x_values = _quantized(M, K)
    w, a = torch.randn(N, K, device=DEVICE) / K**0.5, torch.randn(slots * rank, K, device=DEVICE) / K**0.5
    weight = quantize_weight(torch.cat([w, a]))
    b = (torch.randn(slots, N, rank, device=DEVICE) / rank**0.5).bfloat16()
    rows = LoraRows(None, b, torch.tensor([0.5, 2.0, 1.5], device=DEVICE),
                    torch.tensor([0, -1, 2, 2, 1, -1], dtype=torch.int64, device=DEVICE), slot_stride=rank)
    residual, norm_weight = torch.randn(M, N, device=DEVICE).bfloat16(), torch.rand(N, device=DEVICE) + 0.5
    out, h = skinny_linear_add_rms_norm(x_q, weight, residual, norm_weight, 1e-5, x_scale=x_scale, lora=rows)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x_values.bfloat16(), weight, residual, norm_weight, 1e-5,
                                                          lora=rows)
    assert_close(h, ref_h, torch.bfloat16, scale=2.0)
    assert_close(out, ref_out, torch.bfloat16, scale=2.0)
    base = Fp8Weight(weight.data[:N], weight.scale[:N])
    plain_out, plain_h = skinny_linear_add_rms_norm(x_q, base, residual, norm_weight, 1e-5, x_scale=x_scale)
    for row in (1, 5):  # no adapter
        assert torch.equal(h[row], plain_h[row]) and torch.equal(out[row], plain_out[row])
    assert not torch.equal(h[0], plain_h[0])
