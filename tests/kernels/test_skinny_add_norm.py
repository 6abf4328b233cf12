"""The skinny GEMM's add-norm finish (a projection, the residual add and the next RMSNorm)
against the torch references; the dispatch in kernels.ops."""

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, poisoned, requires_cuda

from tandem.kernels import ops, reference
from tandem.kernels import skinny_gemm as sg

CONFIGS = [None, (16, 32, 4, 2, 1), (32, 64, 4, 3, 2), (16, 32, 4, 3, 3)]


def _case(M, N, K, dtype, device=DEVICE):
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    residual = torch.randn(M, N, device=device).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype)
    return x, w, residual, norm_w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, K", [(2, 37, 200), (17, 64, 96), (64, 130, 128)])
def test_matches_reference(dtype, M, N, K):
    x, w, residual, norm_w = _case(M, N, K, dtype)
    out, h = sg.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-5)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-5)
    assert out.dtype == h.dtype == dtype and out.shape == h.shape == (M, N)
    assert_close(h, ref_h, dtype)
    assert_close(out, ref_out, dtype)


@pytest.mark.parametrize("config", CONFIGS)
def test_splits_and_strided_operands(config):
    """One split (the finish still runs), two, three; x, residual and outputs with row strides;
    NaN past K and past each row's end, so a read outside them shows."""
    base = torch.randn(41, 300, device=DEVICE) / 200**0.5
    base[:, 200:] = float("nan")
    w = base[:, :200]
    x = torch.randn(5, 333, device=DEVICE)[:, :200]
    res_base = torch.randn(5, 50, device=DEVICE)
    res_base[:, 41:] = float("nan")
    residual = res_base[:, :41]
    norm_w = torch.randn(41, device=DEVICE)
    y, new_res = poisoned((5, 60), torch.float32)[:, :41], poisoned((5, 70), torch.float32)[:, :41]
    sg._launch_skinny(x, w, None, y, silu_mul=False, config=config,
                      add_norm=sg.AddNorm(residual, norm_w, 1e-6, new_res))
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-6)
    assert_close(new_res, ref_h, torch.float32)
    assert_close(y, ref_out, torch.float32)


def test_the_product_is_rounded_before_the_add():
    """As linear then the add: 1024 + 1/16 is 1024 in fp16, so with a residual of -1024 the sum is
    exactly 0 (not 1/16), and the norm sees that."""
    x = torch.tensor([[1024.0, 0.0625], [3.0, 0.5]], device=DEVICE).half()
    w = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 2.0]], device=DEVICE).half()
    residual = torch.tensor([[-1024.0, 1.0, 2.0], [1.0, -2.0, 0.25]], device=DEVICE).half()
    norm_w = torch.tensor([1.0, 0.5, 2.0], device=DEVICE).half()
    out, h = sg.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-6)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-6)
    assert h[0, 0].item() == 0.0 and torch.equal(h.cpu(), ref_h.cpu())
    assert_close(out, ref_out, torch.float16)


def test_eps_counts_for_small_rows():
    """Rows of magnitude ~1e-3: mean(h^2) ~ 1e-6, so eps = 1e-5 dominates the scale."""
    x, w, residual, norm_w = _case(4, 48, 64, torch.float32)
    x, residual = x * 1e-3, residual * 1e-3
    for eps in (1e-5, 1e-3):
        out, _ = sg.skinny_linear_add_rms_norm(x, w, residual, norm_w, eps)
        assert_close(out, reference.skinny_linear_add_rms_norm(x, w, residual, norm_w, eps)[0], torch.float32)


def test_ops_sends_2_to_max_rows_to_the_fused_kernel(monkeypatch):
    """The dispatch's row range (CUDA layouts faked: the kernel is a recorder here)."""
    calls = []

    def fused(x, weight, residual, norm_weight, eps, fp8_out=False, lora=None):
        calls.append(x.shape[0])
        return "fused"

    monkeypatch.setattr(ops, "_triton_layout", lambda x, weight, bias: True)
    monkeypatch.setattr(ops, "_triton_impl", lambda name: fused if name == "skinny_linear_add_rms_norm" else None)
    monkeypatch.setattr(ops, "fused_add_rms_norm",
                        lambda y, residual, w, eps, quantize_for=None, keep_values=False, lora=None: "unfused")
    monkeypatch.setattr(ops, "linear", lambda x, weight: x)
    w = torch.empty(8, 4)
    for rows, expected in ((1, "unfused"), (2, "fused"), (ops.FUSED_NORM_MAX_ROWS, "fused"),
                           (ops.FUSED_NORM_MAX_ROWS + 1, "unfused")):
        assert ops.linear_add_rms_norm(torch.empty(rows, 4), w, torch.empty(rows, 8), None, 1e-5) == expected
    assert ops.linear_add_rms_norm(torch.empty(3, 4), w, None, None, 1e-5) == "unfused"  # no residual
    assert ops.linear_add_rms_norm(torch.empty(3, 4), w, torch.empty(3, 7), None, 1e-5) == "unfused"
    assert ops.linear_add_rms_norm(torch.empty(3, 4), w, torch.empty(3, 8).half(), None, 1e-5) == "unfused"
    monkeypatch.setattr(ops, "FUSED_NORM_MAX_ROWS", 0)
    assert ops.linear_add_rms_norm(torch.empty(2, 4), w, torch.empty(2, 8), None, 1e-5) == "unfused"
    assert calls == [2, 64]


def test_bad_operands_are_refused_before_any_write():
    x, w, residual, norm_w = _case(3, 8, 16, torch.float32)
    y, new_res = poisoned((3, 8), torch.float32), poisoned((3, 8), torch.float32)
    bad = [
        sg.AddNorm(residual[:, :7], norm_w, 1e-5, new_res),  # residual of another width
        sg.AddNorm(residual, norm_w[:7], 1e-5, new_res),
        sg.AddNorm(residual.half(), norm_w, 1e-5, new_res),  # another dtype
        sg.AddNorm(residual.T.contiguous().T, norm_w, 1e-5, new_res),  # columns contiguous
    ]
    for add_norm in bad:
        with pytest.raises(AssertionError):
            sg._launch_skinny(x, w, None, y, silu_mul=False, add_norm=add_norm)
    with pytest.raises(AssertionError):  # a SiLU·mul projection has no add-norm finish
        sg._launch_skinny(x, torch.randn(16, 16, device=DEVICE), None, y, silu_mul=True,
                          add_norm=sg.AddNorm(residual, norm_w, 1e-5, new_res))
    assert torch.isnan(y).all() and torch.isnan(new_res).all()


def test_ops_falls_back_off_the_gpu_and_outside_the_rows():
    """On the CPU (and for one token, or more than FUSED_NORM_MAX_ROWS) the op is the unfused pair."""
    for M in (1, 3, ops.FUSED_NORM_MAX_ROWS + 1):
        x, w, residual, norm_w = _case(M, 24, 40, torch.float32, "cpu")
        out, h = ops.linear_add_rms_norm(x, w, residual, norm_w, 1e-5)
        ref_out, ref_h = reference.fused_add_rms_norm(torch.nn.functional.linear(x, w), residual, norm_w, 1e-5)
        assert torch.equal(out, ref_out) and torch.equal(h, ref_h)


_SHAPES = [(4096, 4096), (4096, 11008), (4096, 14336), (2048, 8192), (2048, 2048)]  # o and down: 7B, 8B, 1B


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [2, 8, 32, 64])
@pytest.mark.parametrize("N, K", _SHAPES)
def test_gpu_real_shapes_bf16(M, N, K):
    x, w, residual, norm_w = _case(M, N, K, torch.bfloat16, "cuda")
    out, h = sg.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-5)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x.float(), w.float(), residual.float(), norm_w.float(),
                                                          1e-5)
    assert_close(h, ref_h, torch.bfloat16)
    assert_close(out, ref_out, torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [1, 2, 64, 65])
def test_gpu_through_ops(monkeypatch, M):
    calls = []
    fused = sg.skinny_linear_add_rms_norm
    monkeypatch.setattr(sg, "skinny_linear_add_rms_norm", lambda *args, **kwargs: calls.append(1) or fused(*args, **kwargs))
    ops._triton_impl.cache_clear()
    x, w, residual, norm_w = _case(M, 4096, 11008, torch.bfloat16, "cuda")
    out, h = ops.linear_add_rms_norm(x, w, residual, norm_w, 1e-5)
    ops._triton_impl.cache_clear()
    assert len(calls) == (1 if 2 <= M <= ops.FUSED_NORM_MAX_ROWS else 0)
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x.float(), w.float(), residual.float(), norm_w.float(),
                                                          1e-5)
    assert_close(h, ref_h, torch.bfloat16)
    assert_close(out, ref_out, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, (16, 32, 4, 3, 3)])
def test_a_fused_lora_weights_rows_are_added_in_the_finish(dtype, config):
    """``lora`` (a weight whose rows past N are every slot's A, engine.lora_weights): the finish adds
    each adapter row's LoRA from the workspace's extra columns (summed over the splits) before the
    residual, as the reference (the product's extra columns as the rows' shrinks, then the norm);
    rows of no adapter are the plain finish's."""
    from tandem.kernels.lora_rows import LoraRows

    M, N, K, slots, rank = 6, 40, 96, 3, 16
    x, w, residual, norm_w = _case(M, N, K, dtype)
    a = (torch.randn(slots * rank, K, device=DEVICE) / K**0.5).to(dtype)
    weight = torch.cat([w, a])
    b = (torch.randn(slots, N, rank, device=DEVICE) / rank**0.5).to(dtype)
    rows = LoraRows(None, b, torch.tensor([0.5, 2.0, 1.5], device=DEVICE),
                    torch.tensor([0, -1, 2, 2, 1, -1], dtype=torch.int64, device=DEVICE), slot_stride=rank)
    y, new_res = torch.empty(M, N, device=DEVICE, dtype=dtype), torch.empty(M, N, device=DEVICE, dtype=dtype)
    sg._launch_skinny(x, weight, None, y, silu_mul=False, config=config,
                      add_norm=sg.AddNorm(residual, norm_w, 1e-5, new_res, None, rows))
    ref_out, ref_h = reference.skinny_linear_add_rms_norm(x, weight, residual, norm_w, 1e-5, lora=rows)
    assert_close(new_res, ref_h, dtype, scale=2)
    assert_close(y, ref_out, dtype, scale=2)
    plain_out, plain_h = torch.empty_like(y), torch.empty_like(new_res)
    sg._launch_skinny(x, w, None, plain_out, silu_mul=False, config=config,
                      add_norm=sg.AddNorm(residual, norm_w, 1e-5, plain_h))
    for row in (1, 5):  # no adapter
        assert torch.equal(new_res[row], plain_h[row]) and torch.equal(y[row], plain_out[row])
    assert not torch.equal(new_res[0], plain_h[0])
