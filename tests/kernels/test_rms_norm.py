import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, requires_cuda

from tandem.kernels import reference
from tandem.kernels.rms_norm import fused_add_rms_norm


def _check(x, residual, weight, eps=1e-6):
    normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    ref_normed, ref_residual = reference.fused_add_rms_norm(x, residual, weight, eps)
    assert normed.dtype == x.dtype and normed.shape == x.shape
    assert_close(normed, ref_normed, x.dtype)
    if residual is None:
        assert new_residual is x
    else:
        assert_close(new_residual, ref_residual, x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, hidden", [(1, 64), (7, 96), (5, 1000)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_matches_reference(dtype, num_rows, hidden, with_residual):
    x = torch.randn(num_rows, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(num_rows, hidden, device=DEVICE).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    _check(x, residual, weight)


def test_strided_rows_3d_input_and_fp32_weight():
    base = torch.randn(3, 4, 160, device=DEVICE, dtype=torch.float16)
    x = base[..., :128]  # rows strided by 160
    residual = torch.randn(3, 4, 128, device=DEVICE, dtype=torch.float16)
    weight = torch.randn(128, device=DEVICE)  # fp32 weight with fp16 activations
    _check(x, residual, weight)


def test_empty_batch():
    x = torch.randn(0, 64, device=DEVICE)
    normed, new_residual = fused_add_rms_norm(x, torch.randn(0, 64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-5)
    assert normed.shape == (0, 64) and new_residual.shape == (0, 64)


@gpu
@requires_cuda
@pytest.mark.parametrize("num_rows", [1, 513, 4096])
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_gpu_real_shapes_bf16(num_rows, hidden):
    x = torch.randn(num_rows, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(num_rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = reference.fused_add_rms_norm(x.float(), residual.float(), weight.float(), 1e-5)
    assert_close(new_residual, ref_residual, torch.bfloat16)
    assert_close(normed, ref_normed, torch.bfloat16, scale=2.0)
