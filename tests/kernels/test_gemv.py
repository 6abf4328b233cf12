import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, requires_cuda

from kernels import reference
from kernels.gemv import _launch_gemv, gemv, gemv_silu_mul


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
    base = torch.randn(40, 300, device=DEVICE)
    w = base[:, :256]  # rows 300 apart
    x = torch.randn(256, device=DEVICE)
    for config in [(4, 64, 4, 1), (16, 128, 4, 2), (8, 512, 4, 3)]:
        y = torch.full((40,), float("nan"), device=DEVICE)
        _launch_gemv(x, w, None, y, silu_mul=False, config=config)
        assert_close(y, reference.gemv(x, w), torch.float32)


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
