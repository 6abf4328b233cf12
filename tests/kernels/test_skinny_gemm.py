import pytest
import torch
import triton
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, poisoned, requires_cuda

from tandem.kernels import reference
from tandem.kernels.skinny_gemm import MAX_M, _launch_skinny, skinny_linear, skinny_silu_mul, tile_config

# (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k), small tiles so that the interpreter stays fast:
# one split; two; three, which over K = 200 in 32-wide tiles (7 tiles) leaves the last split one tile
# and over K = 128 (4 tiles) would leave one split empty (the launcher runs it as 2 + 2)
CONFIGS = [(16, 32, 4, 2, 1), (32, 64, 4, 3, 2), (16, 32, 4, 3, 3)]


def _weight(rows, K, scale=1.0, dtype=torch.float32):
    return (scale * torch.randn(rows, K, device=DEVICE) / K**0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 17, 64])
def test_skinny_linear_matches_reference(dtype, M):
    x = torch.randn(M, 200, device=DEVICE).to(dtype)  # K: a whole 128 tile and a ragged one
    w = _weight(37, 200, dtype=dtype)  # N: one partial row block
    out = skinny_linear(x, w)
    assert out.shape == (M, 37) and out.dtype == dtype
    assert_close(out, reference.gemv(x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", [(130, 96), (65, 256)])  # partial last row blocks; K below, at two tiles
def test_skinny_linear_with_bias(dtype, N, K):
    x = torch.randn(5, K, device=DEVICE).to(dtype)
    w, b = _weight(N, K, dtype=dtype), torch.randn(N, device=DEVICE).to(dtype)
    assert_close(skinny_linear(x, w, b), reference.gemv(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, inter, K", [(2, 45, 96), (17, 130, 520), (64, 7, 16)])
def test_skinny_silu_mul_matches_reference(dtype, M, inter, K):
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    w = _weight(2 * inter, K, scale=2.0, dtype=dtype)
    out = skinny_silu_mul(x, w)
    assert out.shape == (M, inter) and out.dtype == dtype
    assert_close(out, reference.gemv_silu_mul(x, w), dtype)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("K", [200, 128])  # ragged (EVEN_K off) and whole tiles
def test_split_k_strided_weight_and_bias(config, K):
    base = torch.randn(41, 300, device=DEVICE) / K**0.5
    base[:, K:] = float("nan")  # a weight read past K (an empty split's, say) poisons the sums
    w = base[:, :K]  # rows 300 apart
    x = torch.randn(17, 333, device=DEVICE)[:, :K]  # token rows 333 apart
    b = torch.randn(41, device=DEVICE)
    for bias in (None, b):
        y = poisoned((17, 50), torch.float32)[:, :41]  # output rows 50 apart
        _launch_skinny(x, w, bias, y, silu_mul=False, config=config)
        assert_close(y, reference.gemv(x, w, bias), torch.float32)


@pytest.mark.parametrize("config", CONFIGS)
def test_split_k_silu_mul_strided_weight(config):
    base = 2 * torch.randn(38, 300, device=DEVICE) / 200**0.5
    base[:, 200:] = float("nan")
    w = base[:, :200]  # rows 300 apart; I = 19: the up rows start mid-block
    x = torch.randn(3, 256, device=DEVICE)[:, :200]  # token rows 256 apart
    y = poisoned((3, 19), torch.float32)
    _launch_skinny(x, w, None, y, silu_mul=True, config=config)
    assert_close(y, reference.gemv_silu_mul(x, w), torch.float32)


@pytest.mark.parametrize("config", [None, CONFIGS[2]])
def test_saturated_gates_stay_finite(config):
    w = torch.zeros(4, 128, device=DEVICE)
    w[0], w[1], w[2:] = -2.5, 2.5, 1.0  # gates -320 and 320
    y = poisoned((2, 2), torch.float32)
    _launch_skinny(torch.ones(2, 128, device=DEVICE), w, None, y, silu_mul=True, config=config)
    assert torch.isfinite(y).all()
    assert_close(y, reference.gemv_silu_mul(torch.ones(2, 128), w.cpu()), torch.float32)


def test_empty_k_gives_the_bias():
    b = torch.randn(3, device=DEVICE)
    out = skinny_linear(torch.randn(2, 0, device=DEVICE), torch.randn(3, 0, device=DEVICE), b)
    assert_close(out, b.expand(2, 3), torch.float32)


def test_bad_shapes_are_refused():
    x, w = torch.randn(2, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
    with pytest.raises(AssertionError):
        skinny_linear(torch.randn(2, 8, device=DEVICE), w)  # K differs
    with pytest.raises(AssertionError):
        skinny_linear(torch.randn(MAX_M + 1, 16, device=DEVICE), w)
    with pytest.raises(AssertionError):
        skinny_linear(x, w.T.contiguous().T)  # columns, not rows, contiguous
    with pytest.raises(AssertionError):
        skinny_linear(x, w, torch.randn(5, device=DEVICE))
    with pytest.raises(AssertionError):
        skinny_silu_mul(x, torch.randn(5, 16, device=DEVICE))  # an odd [gate; up]
    with pytest.raises(AssertionError):
        _launch_skinny(x, w, torch.randn(4, device=DEVICE), poisoned((2, 2), torch.float32), silu_mul=True)


def test_tile_rule_fills_the_grid_and_shared_memory():
    assert tile_config(64, 4096, 4096, False)[4] == 2  # 64 row blocks: 128 programs
    assert tile_config(64, 12288, 4096, False)[4] == 1  # 192 row blocks
    assert tile_config(64, 22016, 4096, True) == (128, 64, 8, 4, 1)  # gate/up above 32 rows: 86 programs
    assert tile_config(48, 16384, 2048, True) == (128, 64, 8, 4, 2)  # 64 programs: K split in two
    assert tile_config(32, 22016, 4096, True)[:4] == (64, 128, 4, 4)  # up to 32 rows: the general rule
    for M in (2, 33, 64, 128):
        for elem_size in (2, 4):  # bf16/fp16, fp32 (a fp32 engine on a GPU: the tests' checkpoints)
            block_n, block_k, _, stages, _ = tile_config(M, 28672, 4096, True, elem_size)
            smem = (2 * block_n + max(16, triton.next_power_of_2(M))) * block_k * elem_size * (stages + 1)
            assert smem <= 227 << 10  # + the peeled tile


_SHAPES = [(12288, 4096, False), (4096, 4096, False), (22016, 4096, True), (4096, 11008, False),
           (6144, 4096, False), (28672, 4096, True), (4096, 14336, False), (3072, 2048, False),
           (16384, 2048, True), (2048, 8192, False)]


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [2, 8, 32, 64, 128])
@pytest.mark.parametrize("N, K, silu", _SHAPES + [(128256, 4096, False)])
def test_gpu_real_shapes_bf16(M, N, K, silu):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (2 * torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    b = None if silu else torch.randn(N, device="cuda", dtype=torch.bfloat16)
    y = poisoned((M, N // 2 if silu else N), torch.bfloat16, "cuda")
    _launch_skinny(x, w, b, y, silu)
    ref = (reference.gemv_silu_mul if silu else reference.gemv)(x.float(), w.float(), *([] if silu else [b.float()]))
    assert_close(y, ref, torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [1, 2, 32, 64, 65])
def test_gpu_through_ops(M):
    """What the model calls: ops.linear and ops.gate_up_silu_mul at the dispatch's edges (the GEMV,
    the skinny GEMM, down projections only at 64, cuBLAS past it) against fp32."""
    from tandem.kernels import ops

    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    qkv = (torch.randn(12288, 4096, device="cuda") / 64).to(torch.bfloat16)
    assert_close(ops.linear(x, qkv), reference.gemv(x.float(), qkv.float()), torch.bfloat16)
    g = (2 * torch.randn(22016, 4096, device="cuda") / 64).to(torch.bfloat16)
    assert_close(ops.gate_up_silu_mul(x, g), reference.gemv_silu_mul(x.float(), g.float()), torch.bfloat16)
    down = (torch.randn(4096, 11008, device="cuda") / 105).to(torch.bfloat16)
    xd = torch.randn(M, 11008, device="cuda", dtype=torch.bfloat16)
    assert_close(ops.linear(xd, down), reference.gemv(xd.float(), down.float()), torch.bfloat16)

