"""RMSNorm fused with the residual add (Triton).

    h      = x + residual            (rounded to x.dtype, as the reference does)
    normed = h / sqrt(mean(h^2) + eps) * weight

One program normalizes one row; the whole row sits in registers, so hidden
sizes up to a few tens of thousands need no inner loop.

``fused_add_rms_norm_fp8`` writes the normed row (rounded to x.dtype) in the per-token FP8 form
an FP8 matmul takes (``kernels.fp8_quant``: codes and a scale per row, the same math), with the
row still in registers: the matmul after it runs no quantization pass of its own.

With ``lora`` (``kernels.lora_rows.LoraRows``: the o or down projection's LoRA in a step with
adapter rows) a row of an adapter first gets its LoRA added to x, rounded to x's dtype as the
expand kernel rounds it: the expand costs no launch of its own and the add and norm stay fused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_kv import soft_round
from tandem.kernels.fp8_quant import row_scale, to_codes
from tandem.kernels.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Rows
from tandem.kernels.lora_rows import LORA_MOST_SPLITS, LoraRows, check
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


# the LoRA rank and split are values of a step: one binary for any (tests/engine/test_warm_up_coverage.py)
@triton.jit(do_not_specialize=["stride_lp_split", "stride_lp_row", "stride_lp_slot", "stride_lb_slot", "lora_rank",
                               "lora_splits"])
def _fused_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, scale_ptr, values_ptr,
    stride_x, stride_residual, stride_out, stride_new_residual,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
    FP8_OUT: tl.constexpr = False, FP8_LIMIT: tl.constexpr = 448.0, SOFT_ROUND: tl.constexpr = False,
    KEEP_VALUES: tl.constexpr = False,
    lp_ptr=None, lb_ptr=None, ls_ptr=None, lslot_ptr=None, stride_lp_split=0, stride_lp_row=0, stride_lp_slot=0,
    stride_lb_slot=0,
    lora_rank=0, lora_splits=0, LORA: tl.constexpr = False, RANK_PAD: tl.constexpr = 16,
    SPLITS_PAD: tl.constexpr = 64,
):
    """Row r:  h = x[r] + residual[r];  out[r] = h * rsqrt(sum(h^2) / hidden + eps) * weight.
    LORA: first, for a row of slot s = lslot[r] >= 0, x[r] = round(x[r] + (sum_i lp[i, r]) @ lb[s]^T
    * ls[s]) in fp32, lb[s] [hidden, lora_rank] (kernels.lora_rows).

    h is rounded to the input dtype before the norm (it is also the new
    residual); the statistic and the product are computed in fp32. FP8_OUT: out[r] rounded to
    the input dtype, then stored as E4M3 codes of out[r] / scale[r], scale[r] = amax / FP8_LIMIT;
    KEEP_VALUES: the rounded row stored to values[r] too (row stride stride_out).
    """
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if LORA:
        slot = tl.load(lslot_ptr + row)
        if slot >= 0:
            x = lora_row_add(x, row, cols, mask, slot, lp_ptr + slot * stride_lp_slot, lb_ptr, ls_ptr,
                              stride_lp_split, stride_lp_row, stride_lb_slot, lora_rank, lora_splits, RANK_PAD,
                              SPLITS_PAD)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, h, mask=mask)
    else:
        h = x
    normed = rms_norm_row(h, weight_ptr, cols, mask, hidden, eps)
    if FP8_OUT:
        normed = normed.to(x.dtype)  # what the unfused norm stores and the quantization reads
        if KEEP_VALUES:
            tl.store(values_ptr + row * stride_out + cols, normed, mask=mask)
        scale = row_scale(tl.max(tl.abs(normed.to(tl.float32)), axis=0), FP8_LIMIT)
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_out + cols, to_codes(normed, scale, FP8_LIMIT, SOFT_ROUND), mask=mask)
    else:
        tl.store(out_ptr + row * stride_out + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lora_row_add(x, row, cols, mask, slot, lp_ptr, lb_ptr, ls_ptr, stride_lp_split, stride_lp_row,
                  stride_lb_slot, rank, splits, RANK_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """x (a row, x's dtype) + its LoRA, rounded once: the shrink's partial sums of the row in one
    load, then the rank columns of its slot's B ([hidden, rank], rank contiguous), unrolled so their
    loads are in flight together."""
    offs_r = tl.arange(0, RANK_PAD)
    offs_s = tl.arange(0, SPLITS_PAD)
    partials = tl.load(lp_ptr + row * stride_lp_row + offs_s[:, None] * stride_lp_split + offs_r[None, :],
                       mask=(offs_s[:, None] < splits) & (offs_r[None, :] < rank), other=0.0).to(tl.float32)
    shrunk = tl.sum(partials, axis=0)  # [RANK_PAD]
    b_row = lb_ptr + slot * stride_lb_slot + cols * rank
    delta = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(RANK_PAD):
        s_r = tl.sum(tl.where(offs_r == r, shrunk, 0.0), axis=0)
        in_rank = mask & (cols * 0 + r < rank)  # RANK_PAD may exceed the rank
        delta += tl.load(b_row + r, mask=in_rank, other=0.0).to(tl.float32) * s_r
    return (x.to(tl.float32) + delta * tl.load(ls_ptr + slot)).to(x.dtype)


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


def _launch_fused_add_rms_norm(x2d, residual2d, weight, out, new_residual, eps, scale=None, values=None,
                               lora: LoraRows | None = None):
    """``scale`` [rows, 1] fp32: ``out`` holds E4M3 codes (FP8_OUT), the rows' scales go there;
    ``values`` (with ``scale``; out's shape and strides, x's dtype): the normed rows as well;
    ``lora``: each adapter row's LoRA added to x first."""
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
    fp8 = {} if scale is None else {"FP8_OUT": True, "FP8_LIMIT": FP8_MAX, "SOFT_ROUND": soft_round(),
                                    "KEEP_VALUES": values is not None}
    if values is not None:
        assert scale is not None and values.shape == out.shape and values.stride() == out.stride()
    if lora is not None:
        check(x2d, lora)
        fp8.update(LORA=True, lp_ptr=lora.partials, lb_ptr=lora.b, ls_ptr=lora.scales, lslot_ptr=lora.row_slots,
                   stride_lp_split=lora.partials.stride(0), stride_lp_row=lora.partials.stride(1),
                   stride_lp_slot=lora.slot_stride,
                   stride_lb_slot=lora.b.stride(0), lora_rank=lora.b.shape[2], lora_splits=lora.partials.shape[0],
                   RANK_PAD=triton.next_power_of_2(lora.b.shape[2]), SPLITS_PAD=LORA_MOST_SPLITS)
    _fused_add_rms_norm_kernel[(num_rows,)](
        x2d, residual2d if has_residual else x2d, weight, out, new_residual if has_residual else out,
        out if scale is None else scale, out if values is None else values,
        x2d.stride(0),
        residual2d.stride(0) if has_residual else 0,
        out.stride(0),
        new_residual.stride(0) if has_residual else 0,
        hidden, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=row_num_warps(block), **fp8, **launch_options(x2d),
    )


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, lora: LoraRows | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (or x); return (h / rms(h) * weight, h). Math in fp32. ``lora``: as the reference's."""
    hidden = x.shape[-1]
    x2d = _as_rows(x)
    residual2d = None if residual is None else _as_rows(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., hidden]
    new_residual = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_fused_add_rms_norm(
        x2d, residual2d, weight.contiguous(), out.view(-1, hidden),
        None if residual is None else new_residual.view(-1, hidden), float(eps), lora=lora,
    )
    return out, new_residual


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, keep_values: bool = False,
    lora: LoraRows | None = None,
) -> tuple[Fp8Rows, torch.Tensor]:
    """As ``reference.fused_add_rms_norm_fp8``: (the normed rows as Fp8Rows [T, hidden], with
    their values in x's dtype if ``keep_values``, h)."""
    hidden = x.shape[-1]
    x2d = _as_rows(x)
    residual2d = None if residual is None else _as_rows(residual)
    codes = torch.empty(x2d.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x2d.shape[0], 1), dtype=torch.float32, device=x.device)
    values = torch.empty(x2d.shape, dtype=x.dtype, device=x.device) if keep_values else None
    new_residual = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_fused_add_rms_norm(
        x2d, residual2d, weight.contiguous(), codes,
        None if residual is None else new_residual.view(-1, hidden), float(eps), scale, values, lora,
    )
    return Fp8Rows(codes, scale, x.dtype, values), new_residual
