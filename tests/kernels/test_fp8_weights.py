"""FP8 weights (kernels.fp8_weight) through every matmul kernel, against the torch references.

Small shapes run where the kernels run (the Triton interpreter on the CPU, which loads and
widens float8 exactly); the ``gpu`` tests take real projection shapes. A kernel that widens
E4M3 in registers and scales each row's sum matches the reference (the same FP8 weight
dequantized in fp32) as closely as its bf16 form matches its own; only the tensor-core path
(x quantized per token as well) is compared with a tolerance of FP8's own.
"""


import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, poisoned, requires_cuda
from kernel_testing import random_fp8 as _fp8
from kernel_testing import shaped_like as _like

from tandem.kernels import ops, reference
from tandem.kernels.fp8_quant import quantize_rows_fp8
from tandem.kernels.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Weight, dequantize, fuse, quantize_weight
from tandem.kernels.gemv import _launch_gemv, gemv, gemv_silu_mul
from tandem.kernels.skinny_gemm import _launch_skinny, skinny_linear, skinny_linear_add_rms_norm, skinny_silu_mul
from tandem.kernels import switches


def _rel_err(actual, expected) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# -- the representation ------------------------------------------------------------------------

def test_per_row_quantization_rounds_each_value_to_its_nearest_e4m3_step():
    w = torch.randn(33, 200) * torch.logspace(-3, 2, 33)[:, None]
    w[5] = 0.0  # an all-zero row: scale 1, codes 0
    q = quantize_weight(w)
    assert q.data.dtype == FP8_DTYPE and q.scale.dtype == torch.float32 and q.scale.shape == (33,)
    amax = w.abs().amax(1)
    torch.testing.assert_close(q.scale[amax > 0], amax[amax > 0] / FP8_MAX, rtol=0, atol=0)
    assert q.scale[5] == 1.0 and (q.data[5].float() == 0).all()
    assert (q.data.float().abs().amax(1)[amax > 0] == FP8_MAX).all()  # each row's largest value is 448
    err = (dequantize(q) - w).abs()
    # E4M3 keeps 3 mantissa bits: half a step is 1/16 of a normal value's binade, 2^-10 of the scale below 2^-6
    assert (err <= torch.maximum(w.abs() / 16, q.scale[:, None] * 2**-10) * (1 + 1e-6)).all()


def test_cpu_dequantization_is_torchs_float8_cast_bit_for_bit():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
    codes = codes[~codes.float().isnan()].repeat(40).reshape(40, -1)  # every finite code (254), 40 rows
    scale = torch.rand(40) * 3
    expected = codes.to(torch.float32) * scale[:, None]
    assert torch.equal(dequantize(Fp8Weight(codes, scale)), expected)
    assert torch.equal(dequantize(Fp8Weight(codes, scale), torch.bfloat16), expected.to(torch.bfloat16))


def test_fused_parts_are_the_fused_matrix_quantized_per_row():
    q, k, v = torch.randn(16, 64), torch.randn(8, 64) * 5, torch.randn(8, 64) / 5
    fused = fuse([quantize_weight(t) for t in (q, k, v)])
    whole = quantize_weight(torch.cat([q, k, v]))
    assert torch.equal(fused.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(fused.scale, whole.scale)


# -- the GEMV (one token) --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", [(1, 16), (37, 96), (130, 600), (13, 2100)])  # partial row blocks, ragged K
def test_gemv_fp8_matches_reference(dtype, N, K):
    x = torch.randn(1, K, device=DEVICE).to(dtype)
    w = _fp8(N, K)
    b = torch.randn(N, device=DEVICE).to(dtype)
    for bias in (None, b):
        out = gemv(x, w, bias)
        assert out.shape == (1, N) and out.dtype == dtype
        assert_close(out, reference.gemv(x, w, bias), dtype, _F16_PRODUCTS_SLACK.get(dtype, 1))


# The FP8 rule's f16x2 products (16-bit activations) round each product to fp16: a few of fp16's
# ulps on the sum, far inside bf16's tolerance, past fp16's own
_F16_PRODUCTS_SLACK = {torch.float16: 4}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter, K", [(1, 16), (45, 96), (6, 1536)])
def test_gemv_silu_mul_fp8_matches_reference(dtype, inter, K):
    x = torch.randn(1, K, device=DEVICE).to(dtype)
    w = _fp8(2 * inter, K, scale=2.0)
    out = gemv_silu_mul(x, w)
    assert out.shape == (1, inter)
    assert_close(out, reference.gemv_silu_mul(x, w), dtype, _F16_PRODUCTS_SLACK.get(dtype, 1))


def test_gemv_fp8_strided_rows_and_tile_overrides():
    q = _fp8(40, 300)
    w = Fp8Weight(q.data[:, :256], q.scale)  # rows 300 apart
    x = torch.randn(256, device=DEVICE)
    for config in [(4, 64, 4, 1), (16, 128, 4, 2), (4, 64, 4, 2, True), (16, 128, 4, 2, True),
                   (4, 64, 4, 2, False, True), (16, 128, 4, 2, True, True)]:
        for silu in (False, True):
            y = poisoned((20 if silu else 40,), torch.float32)
            _launch_gemv(x, w, None, y, silu_mul=silu, config=config)
            f16 = len(config) > 5 and config[5]  # fp16 products: bf16's tolerance
            assert_close(y, (reference.gemv_silu_mul if silu else reference.gemv)(x, w),
                         torch.bfloat16 if f16 else torch.float32)


def test_gemv_fp8_f16_products_keep_large_and_small_activations():
    """F16_PRODUCTS sums f16x2 products of x * X_F16_SHIFT: activations of thousands (LLMs' outlier
    channels) neither overflow nor lose the rest of the row, and tiny ones keep their precision."""
    q = _fp8(32, 1024)
    for magnitude, outlier in ((1e3, 8e3), (1.0, 64.0), (1e-3, 0.0)):
        x = torch.randn(1024, device=DEVICE) * magnitude
        x[7] = outlier  # an outlier channel
        for silu in (False, True):
            ref = (reference.gemv_silu_mul if silu else reference.gemv)(x, q)
            y = poisoned((16 if silu else 32,), torch.float32)
            _launch_gemv(x, q, None, y, silu_mul=silu, config=(4, 256, 4, 2, False, True))
            assert torch.isfinite(y).all()
            torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def test_fp8_weights_are_checked():
    q = _fp8(4, 16)
    with pytest.raises(AssertionError):
        gemv(torch.randn(1, 16, device=DEVICE), Fp8Weight(q.data, q.scale.to(torch.bfloat16)))
    with pytest.raises(AssertionError):
        gemv(torch.randn(1, 16, device=DEVICE), Fp8Weight(q.data, q.scale[:3]))
    with pytest.raises(AssertionError):
        skinny_linear(torch.randn(2, 16, device=DEVICE), Fp8Weight(q.data.float(), q.scale))


# -- the skinny GEMM (decode batches) -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [2, 17, 64])
def test_skinny_linear_fp8_matches_reference(dtype, M):
    x = torch.randn(M, 200, device=DEVICE).to(dtype)
    w, b = _fp8(37, 200), torch.randn(37, device=DEVICE).to(dtype)
    out = skinny_linear(x, w, b)
    assert out.shape == (M, 37) and out.dtype == dtype
    assert_close(out, reference.gemv(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, inter, K", [(2, 45, 96), (17, 19, 520)])
def test_skinny_silu_mul_fp8_matches_reference(dtype, M, inter, K):
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = _fp8(2 * inter, K, scale=2.0)  # I = 19: the up rows start mid-block
    assert_close(skinny_silu_mul(x, w), reference.gemv_silu_mul(x, w), dtype)


@pytest.mark.parametrize("config", [(16, 32, 4, 2, 1), (32, 64, 4, 3, 2), (16, 32, 4, 3, 3)])
def test_skinny_fp8_split_k_scales_each_partial(config):
    """Split K: every split's partial sums carry the row scale, so the finishing kernel is unchanged."""
    x = torch.randn(17, 200, device=DEVICE)
    w, b = _fp8(41, 200), torch.randn(41, device=DEVICE)
    y = poisoned((17, 41), torch.float32)
    _launch_skinny(x, w, b, y, silu_mul=False, config=config)
    assert_close(y, reference.gemv(x, w, b), torch.float32)
    g = _fp8(38, 200, scale=2.0)
    y = poisoned((17, 19), torch.float32)
    _launch_skinny(x, g, None, y, silu_mul=True, config=config)
    assert_close(y, reference.gemv_silu_mul(x, g), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_add_norm_fp8_matches_reference(dtype):
    x, residual = torch.randn(6, 96, device=DEVICE).to(dtype), torch.randn(6, 40, device=DEVICE).to(dtype)
    w, norm_weight = _fp8(40, 96), torch.rand(40, device=DEVICE) + 0.5
    out, h = skinny_linear_add_rms_norm(x, w, residual, norm_weight, 1e-6)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x, w, residual, norm_weight, 1e-6)
    assert_close(h, ref_h, dtype)
    assert_close(out, ref_out, dtype)


# -- per-token activation quantization (the tensor-core path's input) --------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, K", [(1, 16), (5, 300), (3, 5000)])  # one tile, ragged, two 4096 tiles
def test_quantize_rows_fp8_is_the_reference_bit_for_bit(dtype, M, K):
    x = (torch.randn(M, K, device=DEVICE) * torch.logspace(-4, 3, M, device=DEVICE)[:, None]).to(dtype)
    x[0, :3] = torch.tensor([1e-9, -3e-7, 0.0])  # below E4M3's subnormals once scaled
    if M > 1:
        x[1] = 0.0  # a zero row: scale 1
    q, scale = quantize_rows_fp8(x)
    ref_q, ref_scale = reference.quantize_rows_fp8(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (M, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_quantize_rows_fp8_strided_rows():
    x = torch.randn(4, 300, device=DEVICE)[:, :256]
    q, scale = quantize_rows_fp8(x)
    ref_q, ref_scale = reference.quantize_rows_fp8(x)
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


# -- the dispatch -----------------------------------------------------------------------------------

def test_dispatch_sends_fp8_weights_to_the_gemv_and_the_skinny_gemm(monkeypatch):
    monkeypatch.delenv("TANDEM_GEMV", raising=False)
    switches.reload()
    monkeypatch.setenv("TANDEM_FP8_SKINNY_MAX_ROWS", str(ops.SKINNY_GEMM_MAX_ROWS))  # the weight-only form's rows
    switches.reload()
    w = Fp8Weight(_like((12, 16), dtype=FP8_DTYPE), _like((12,), dtype=torch.float32))
    kind = ops._triton_matmul
    for dtype in DTYPES:  # any activation dtype: the kernels widen E4M3 to it
        assert kind(_like((1, 16), dtype=dtype), w, None) == "gemv"
        assert kind(_like((2, 16), dtype=dtype), w, None) == "skinny"
    assert kind(_like((ops.SKINNY_GEMM_MAX_ROWS + 1, 16)), w, None) is None  # past them: fp8_matmul
    assert kind(_like((2, 16)), Fp8Weight(w.data, _like((12,), dtype=torch.bfloat16)), None) is None
    assert kind(_like((2, 16)), Fp8Weight(w.data, _like((11,), dtype=torch.float32)), None) is None
    assert kind(_like((2, 16)), Fp8Weight(w.data, _like((12,), stride=(2,), dtype=torch.float32)), None) is None
    assert kind(_like((2, 16)), Fp8Weight(_like((12, 16), stride=(1, 12), dtype=FP8_DTYPE), w.scale), None) is None
    assert kind(_like((2, 16), cuda=False), w, None) is None


def test_ops_on_the_cpu_dequantize_then_multiply():
    x = torch.randn(5, 64)
    w, g, b = _fp8(24, 64), _fp8(2 * 12, 64), torch.randn(24)
    torch.testing.assert_close(ops.linear(x, w, b), reference.gemv(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.gate_up_silu_mul(x, g), reference.gemv_silu_mul(x, g), rtol=1e-5, atol=1e-5)
    residual, norm_weight = torch.randn(5, 24), torch.rand(24) + 0.5
    out, h = ops.linear_add_rms_norm(x, w, residual, norm_weight, 1e-6)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x, w, residual, norm_weight, 1e-6)
    torch.testing.assert_close((out, h), (ref_out, ref_h), rtol=1e-5, atol=1e-5)
    assert ops.linear(x.bfloat16(), w).dtype == torch.bfloat16


# -- real shapes on a GPU ------------------------------------------------------------------------------

_SHAPES = [(12288, 4096), (4096, 4096), (6144, 4096), (4096, 11008), (4096, 14336), (3072, 2048), (2048, 8192)]
_GATE_UP = [(11008, 4096), (14336, 4096), (8192, 2048)]


@gpu
@requires_cuda
@pytest.mark.parametrize("N, K", _SHAPES)
def test_gpu_gemv_fp8_real_shapes(N, K):
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w, b = _fp8(N, K, device="cuda"), torch.randn(N, device="cuda", dtype=torch.bfloat16)
    assert_close(gemv(x, w, b), reference.gemv(x.float(), w, b.float()), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("inter, K", _GATE_UP)
def test_gpu_gemv_silu_mul_fp8_real_shapes(inter, K):
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = _fp8(2 * inter, K, scale=2.0, device="cuda")
    assert_close(gemv_silu_mul(x, w), reference.gemv_silu_mul(x.float(), w), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("N, K, silu", [(n, k, False) for n, k in _SHAPES] + [(2 * i, k, True) for i, k in _GATE_UP])
def test_gpu_gemv_fp8_f16_products_real_shapes(N, K, silu):
    """The F16_PRODUCTS form (compiled for the GPU: f16x2 FMAs) against the fp32 reference."""
    x = torch.randn(K, device="cuda", dtype=torch.bfloat16)
    w = _fp8(N, K, scale=2.0, device="cuda")
    y = poisoned((N // 2 if silu else N,), torch.bfloat16, "cuda")
    _launch_gemv(x, w, None, y, silu, (4, 512 if silu else 2048, 4, 2, False, True))
    assert_close(y, (reference.gemv_silu_mul if silu else reference.gemv)(x.float(), w), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [2, 8, 32, 64, 128])
@pytest.mark.parametrize("N, K, silu", [(n, k, False) for n, k in _SHAPES] + [(2 * i, k, True) for i, k in _GATE_UP])
def test_gpu_skinny_fp8_real_shapes(M, N, K, silu):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = _fp8(N, K, scale=2.0, device="cuda")
    y = poisoned((M, N // 2 if silu else N), torch.bfloat16, "cuda")
    _launch_skinny(x, w, None, y, silu)
    assert_close(y, (reference.gemv_silu_mul if silu else reference.gemv)(x.float(), w), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [2, 8, 64])
@pytest.mark.parametrize("N, K", [(4096, 4096), (4096, 14336)])
def test_gpu_skinny_add_norm_fp8_real_shapes(M, N, K):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w, residual = _fp8(N, K, device="cuda"), torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.rand(N, device="cuda") + 0.5
    out, h = skinny_linear_add_rms_norm(x, w, residual, norm_weight, 1e-5)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x, w, residual, norm_weight, 1e-5)
    assert_close(h, ref_h, torch.bfloat16)
    assert_close(out, ref_out, torch.bfloat16, scale=2.0)  # two bf16 roundings apart at most


@gpu
@requires_cuda
@pytest.mark.parametrize("M, K", [(1, 4096), (64, 14336), (2048, 4096), (2048, 14336)])
def test_gpu_quantize_rows_fp8_bit_for_bit(M, K):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = quantize_rows_fp8(x)
    ref_q, ref_scale = reference.quantize_rows_fp8(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [1, 2, 32, 64, 65, 2048])
def test_gpu_fp8_through_ops(M):
    """What the model calls, at the dispatch's edges (GEMV, skinny GEMM, FP8 tensor cores past 64
    rows or 32 for qkv), against the same FP8 weights in fp32: within bf16's tolerance where only
    the weight is FP8, within a relative 5% where x is quantized per token too (E4M3 keeps 3
    mantissa bits: ~3% relative noise on random data); and against the unquantized weights."""
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    dense = torch.randn(12288, 4096, device="cuda") / 64
    qkv = quantize_weight(dense)
    b = torch.randn(12288, device="cuda", dtype=torch.bfloat16)
    gate_up = _fp8(28672, 4096, scale=2.0, device="cuda")
    down, xd = _fp8(4096, 14336, device="cuda"), torch.randn(M, 14336, device="cuda", dtype=torch.bfloat16)
    fp8_rows = ops.fp8_skinny_max_rows()  # past these x is quantized as well
    cases = [(ops.linear(x, qkv, b), reference.gemv(x.float(), qkv, b.float()),
              M <= min(ops.SKINNY_GEMM_MAX_ROWS, fp8_rows)),
             (ops.gate_up_silu_mul(x, gate_up), reference.gemv_silu_mul(x.float(), gate_up),
              M <= min(ops.SKINNY_SILU_MUL_MAX_ROWS, fp8_rows)),
             (ops.linear(xd, down), reference.gemv(xd.float(), down), M <= min(ops.SKINNY_GEMM_LONG_K_MAX_ROWS, fp8_rows))]
    for out, ref, weight_only in cases:
        if weight_only:
            assert_close(out, ref, torch.bfloat16)
        else:
            assert _rel_err(out, ref) < 0.05
    assert _rel_err(ops.linear(x, qkv), x.float() @ dense.T) < 0.07  # FP8 against the unquantized weight
