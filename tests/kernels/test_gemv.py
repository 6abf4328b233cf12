import types

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, requires_cuda, run_ptx_check

from tandem.kernels import reference
from tandem.kernels.gemv import _launch_gemv, gemv, gemv_silu_mul
from tandem.kernels import switches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", [(1, 16), (37, 96), (130, 600), (64, 1024)])  # partial row blocks, K not a tile
def test_gemv_matches_reference(dtype, N, K):
    x = torch.randn(1, K, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) / K**0.5).to(dtype)
    out = gemv(x, w)
    assert out.shape == (1, N) and out.dtype == dtype
    assert_close(out, reference.gemv(x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_with_bias_and_a_flat_input(dtype):
    x = torch.randn(200, device=DEVICE).to(dtype)
    w, b = torch.randn(50, 200, device=DEVICE).to(dtype) / 14, torch.randn(50, device=DEVICE).to(dtype)
    out = gemv(x, w, b)
    assert out.shape == (50,)
    assert_close(out, reference.gemv(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter, K", [(1, 16), (45, 96), (130, 520)])
def test_gemv_silu_mul_matches_reference(dtype, inter, K):
    x = torch.randn(1, K, device=DEVICE).to(dtype)
    w = (2 * torch.randn(2 * inter, K, device=DEVICE) / K**0.5).to(dtype)
    out = gemv_silu_mul(x, w)
    assert out.shape == (1, inter)
    assert_close(out, reference.gemv_silu_mul(x, w), dtype)


def test_strided_weight_rows_and_tile_overrides():
    base = torch.randn(40, 300, device=DEVICE) / 256**0.5
    w = base[:, :256]  # rows 300 apart; sums O(1), within the fp32 tolerance
    x = torch.randn(256, device=DEVICE)
    for config in [(4, 64, 4, 1), (16, 128, 4, 2), (8, 512, 4, 3), (4, 64, 4, 2, True)]:
        y = torch.full((40,), float("nan"), device=DEVICE)
        _launch_gemv(x, w, None, y, silu_mul=False, config=config)
        assert_close(y, reference.gemv(x, w), torch.float32)


def test_prefetched_tiles_with_a_partial_last_tile():
    """PREFETCH (the next tile's loads before this tile's math) over K = 300: two whole tiles and a
    partial one, both forms."""
    w = torch.randn(40, 300, device=DEVICE) / 300**0.5
    x = torch.randn(300, device=DEVICE)
    for silu in (False, True):
        y = torch.full((20 if silu else 40,), float("nan"), device=DEVICE)
        _launch_gemv(x, w, None, y, silu_mul=silu, config=(4, 128, 4, 2, True))
        assert_close(y, (reference.gemv_silu_mul if silu else reference.gemv)(x, w), torch.float32)


def test_bad_shapes_are_refused():
    with pytest.raises(AssertionError):
        gemv(torch.randn(1, 8, device=DEVICE), torch.randn(4, 16, device=DEVICE))
    with pytest.raises(AssertionError):
        gemv_silu_mul(torch.randn(1, 16, device=DEVICE), torch.randn(5, 16, device=DEVICE))


@gpu
@requires_cuda
@pytest.mark.parametrize("N, K", [(12288, 4096), (4096, 4096), (4096, 11008), (6144, 4096), (32000, 4096),
                                  (128256, 4096), (4096, 14336)])
def test_gpu_real_shapes_bf16(N, K):
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    assert_close(gemv(x, w), reference.gemv(x.float(), w.float()), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("inter, K", [(11008, 4096), (14336, 4096), (8192, 2048)])
def test_gpu_silu_mul_real_shapes_bf16(inter, K):
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = (2 * torch.randn(2 * inter, K, device="cuda") / K**0.5).to(torch.bfloat16)
    assert_close(gemv_silu_mul(x, w), reference.gemv_silu_mul(x.float(), w.float()), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter, K", [(5, 1024), (6, 1536), (3, 1100)])  # K over one 512 tile: even, ragged
def test_gemv_silu_mul_k_loop(dtype, inter, K):
    x = torch.randn(1, K, device=DEVICE).to(dtype)
    w = (2 * torch.randn(2 * inter, K, device=DEVICE) / K**0.5).to(dtype)
    assert_close(gemv_silu_mul(x, w), reference.gemv_silu_mul(x, w), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, K", [(9, 1100), (5, 2088), (3, 3000), (13, 8200)])  # 1024 tiles, ragged; 8-row rule
def test_gemv_k_loop_and_bias(dtype, N, K):
    x = torch.randn(1, K, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) / K**0.5).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype)
    assert_close(gemv(x, w, b), reference.gemv(x, w, b), dtype)


def test_gemv_silu_mul_strided_weight_and_saturated_gates():
    torch.manual_seed(0)
    w = (2 * torch.randn(14, 300, device=DEVICE) / 256**0.5)[:, :256]  # rows 300 apart; gates O(1)
    x = torch.randn(256, device=DEVICE)
    for config in [(4, 64, 4, 1), (4, 128, 4, 2), (2, 512, 4, 3), (4, 64, 4, 2, True)]:
        y = torch.full((7,), float("nan"), device=DEVICE)
        _launch_gemv(x, w, None, y, silu_mul=True, config=config)
        assert_close(y, reference.gemv_silu_mul(x, w), torch.float32)
    w = torch.zeros(4, 16, device=DEVICE)
    w[0], w[1], w[2:] = -20.0, 20.0, 1.0  # gates -320 and 320
    out = gemv_silu_mul(torch.ones(1, 16, device=DEVICE), w)
    assert torch.isfinite(out).all()
    assert_close(out, reference.gemv_silu_mul(torch.ones(1, 16), w.cpu()), torch.float32)


def test_empty_k_gives_the_bias():
    b = torch.randn(3, device=DEVICE)
    assert_close(gemv(torch.randn(1, 0, device=DEVICE), torch.randn(3, 0, device=DEVICE), b), b[None], torch.float32)


def _like(shape, stride=None, cuda=True, dtype=torch.bfloat16):
    """A stand-in with a CUDA tensor's layout attributes (the dispatch reads nothing else)."""
    if stride is None:
        stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    return types.SimpleNamespace(is_cuda=cuda, shape=torch.Size(shape), dtype=dtype, dim=lambda: len(shape),
                                 stride=lambda i=None: stride if i is None else stride[i])


def test_dispatch_sends_only_their_layouts_to_the_gemv_and_the_skinny_gemm(monkeypatch):
    from tandem.kernels import ops
    from tandem.kernels.skinny_gemm import MAX_M

    assert ops.SKINNY_GEMM_ROWS_LIMIT == MAX_M

    monkeypatch.delenv("TANDEM_GEMV", raising=False)
    switches.reload()
    w = _like((12, 16))  # K < 2N
    kind = ops._triton_matmul
    assert kind(_like((1, 16)), w, None) == "gemv"
    assert kind(_like((1, 16)), w, _like((12,))) == "gemv"
    assert kind(_like((2, 16)), w, None) == "skinny"  # a decode batch
    assert kind(_like((ops.SKINNY_GEMM_MAX_ROWS, 16)), w, _like((12,))) == "skinny"
    assert kind(_like((ops.SKINNY_GEMM_MAX_ROWS + 1, 16)), w, None) is None  # cuBLAS
    long_k = _like((8, 17))  # K >= 2N (a down projection)
    assert kind(_like((ops.SKINNY_GEMM_LONG_K_MAX_ROWS, 17)), long_k, None) == "skinny"
    assert kind(_like((ops.SKINNY_GEMM_LONG_K_MAX_ROWS + 1, 17)), long_k, None) is None
    assert kind(_like((48, 16)), w, None, 64) == "skinny"  # a rule of its own (gate/up + SiLU·mul)
    assert kind(_like((65, 16)), w, None, 64) is None
    assert kind(_like((2, 17)), long_k, None, 1) is None
    assert kind(_like((0, 16)), w, None) is None
    assert kind(_like((4, 16), stride=(32, 2)), w, None) is None  # strided columns
    assert kind(_like((1, 2, 16)), w, None) is None  # 3-D
    assert kind(_like((1, 16), cuda=False), w, None) is None
    assert kind(_like((4, 16), dtype=torch.float32), w, None) is None
    assert kind(_like((1, 16)), _like((12, 16), stride=(1, 12)), None) is None  # a transposed view
    assert kind(_like((4, 16)), w, _like((12,), stride=(2,))) is None
    assert kind(_like((4, 16)), w, _like((12,), dtype=torch.float32)) is None  # F.linear's own error or cast
    assert kind(_like((4, 16)), w, _like((11,))) is None
    monkeypatch.setattr(ops, "SKINNY_GEMM_MAX_ROWS", 1000)  # never past what the kernels take
    assert kind(_like((ops.SKINNY_GEMM_ROWS_LIMIT, 16)), w, None) == "skinny"
    assert kind(_like((ops.SKINNY_GEMM_ROWS_LIMIT + 1, 16)), w, None) is None
    assert kind(_like((ops.SKINNY_GEMM_ROWS_LIMIT, 17)), long_k, None) == "skinny"  # the larger limit for long K
    monkeypatch.setattr(ops, "SKINNY_GEMM_MAX_ROWS", 0)
    assert kind(_like((2, 16)), w, None) is None
    assert kind(_like((2, 17)), long_k, None) == "skinny"
    monkeypatch.setattr(ops, "SKINNY_GEMM_LONG_K_MAX_ROWS", 0)
    assert kind(_like((2, 17)), long_k, None) is None
    monkeypatch.setenv("TANDEM_GEMV", "0")
    switches.reload()
    assert kind(_like((1, 16)), w, None) is None


def test_fp8_gemv_issues_its_weight_loads_before_the_loops_barriers_and_f16_products_stay_f16x2():
    """gemv_ptx_check.py compiles the FP8 forms for sm90 (outside the interpreter) and reads their PTX."""
    assert "ok: 16 FP8 GEMV forms" in run_ptx_check("gemv_ptx_check.py")
