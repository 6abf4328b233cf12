"""RMSNorm fused with the residual add (Triton).

    h      = x + residual            (rounded to x.dtype, as the reference does)
    normed = h / sqrt(mean(h^2) + eps) * weight

One program normalizes one row; the whole row sits in registers, so hidden
sizes up to a few tens of thousands need no inner loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x, stride_residual, stride_out, stride_new_residual,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Row r:  h = x[r] + residual[r];  out[r] = h * rsqrt(sum(h^2) / hidden + eps) * weight.

    h is rounded to the input dtype before the norm (it is also the new
    residual); the statistic and the product are computed in fp32.
    """
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, h, mask=mask)
    else:
        h = x
    normed = rms_norm_row(h, weight_ptr, cols, mask, hidden, eps)
    tl.store(out_ptr + row * stride_out + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_row(h, weight_ptr, cols, mask, hidden, eps):
    """One whole row h (masked lanes 0) -> h * rsqrt(sum(h^2) / hidden + eps) * weight[cols], fp32.
    Also the skinny GEMM's add-norm finish (kernels.skinny_gemm): the same math in both."""
    hf = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    return hf * inv_rms * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)


def row_num_warps(block: int) -> int:
    # ~8 to 16 elements per thread
    return max(1, min(16, block // 256))


def _launch_fused_add_rms_norm(x2d, residual2d, weight, out, new_residual, eps):
    num_rows, hidden = x2d.shape
    assert weight.shape == (hidden,) and weight.stride(0) == 1, "weight must be contiguous [hidden]"
    assert x2d.stride(1) == 1 and out.stride(1) == 1, "last dim must be contiguous"
    if residual2d is not None:
        assert residual2d.shape == x2d.shape and residual2d.stride(1) == 1
        assert residual2d.dtype == x2d.dtype, "x and residual must share a dtype"
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual2d is not None
    _fused_add_rms_norm_kernel[(num_rows,)](
        x2d, residual2d if has_residual else x2d, weight, out, new_residual if has_residual else out,
        x2d.stride(0),
        residual2d.stride(0) if has_residual else 0,
        out.stride(0),
        new_residual.stride(0) if has_residual else 0,
        hidden, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=row_num_warps(block), **launch_options(x2d),
    )


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (or x); return (h / rms(h) * weight, h). Math in fp32."""
    hidden = x.shape[-1]
    x2d = _as_rows(x)
    residual2d = None if residual is None else _as_rows(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., hidden]
    new_residual = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_fused_add_rms_norm(
        x2d, residual2d, weight.contiguous(), out.view(-1, hidden),
        None if residual is None else new_residual.view(-1, hidden), float(eps),
    )
    return out, new_residual
