import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, requires_cuda

from tandem.kernels import reference
from tandem.kernels.activation import silu_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, inter", [(1, 16), (7, 96), (3, 2500)])
def test_matches_reference(dtype, num_tokens, inter):
    x = (3 * torch.randn(num_tokens, 2 * inter, device=DEVICE)).to(dtype)
    out = silu_mul(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    assert_close(out, reference.silu_mul(x), dtype)


def test_strided_rows_and_3d():
    base = torch.randn(2, 5, 300, device=DEVICE)
    x = base[..., :256]
    assert_close(silu_mul(x), reference.silu_mul(x), torch.float32)


def test_empty_batch():
    assert silu_mul(torch.randn(0, 64, device=DEVICE)).shape == (0, 32)


@gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize("inter", [11008, 14336])
def test_gpu_real_shapes_bf16(num_tokens, inter):
    x = torch.randn(num_tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
    assert_close(silu_mul(x), reference.silu_mul(x.float()), torch.bfloat16)
