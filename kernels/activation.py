"""SiLU-and-multiply of the gate/up projection (Triton).

    x = [gate | up]  (last dim 2 * inter)  ->  silu(gate) * up

``silu_mul_fp8`` writes the product (rounded to x.dtype) in the per-token FP8 form an FP8 matmul
takes (``kernels.fp8_quant``'s math): one program a row, a pass for the row's amax and a second
(x again, from L2) for the codes, so the down projection runs no quantization pass of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_kv import soft_round
from tandem.kernels.fp8_quant import row_scale, to_codes
from tandem.kernels.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Rows
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """out[r, c] = g / (1 + exp(-g)) * u   with g = x[r, c], u = x[r, inter + c], in fp32."""
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_row(x_row, cols, mask, inter):
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(gate.dtype)  # rounded as silu_mul stores it


@triton.jit
def _silu_mul_fp8_kernel(
    x_ptr, q_ptr, s_ptr, values_ptr, stride_x, stride_q, inter,
    BLOCK: tl.constexpr, FP8_LIMIT: tl.constexpr, SOFT_ROUND: tl.constexpr, USE_PDL: tl.constexpr = False,
    KEEP_VALUES: tl.constexpr = False,
):
    """Row r: a = silu(gate) * up rounded to x's dtype (as _silu_mul_kernel);
    s[r] = amax(|a|) / FP8_LIMIT (1 for zeros), q[r] = E4M3(a / s[r]); KEEP_VALUES: a stored to
    values[r] too (row stride stride_q)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + offs
        a = _silu_mul_row(x_row, cols, cols < inter, inter)
        if KEEP_VALUES:
            tl.store(values_ptr + row * stride_q + cols, a, mask=cols < inter)
        amax = tl.maximum(amax, tl.abs(a.to(tl.float32)))
    scale = row_scale(tl.max(amax, axis=0), FP8_LIMIT)
    tl.store(s_ptr + row, scale)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + offs
        mask = cols < inter
        a = _silu_mul_row(x_row, cols, mask, inter)
        tl.store(q_ptr + row * stride_q + cols, to_codes(a, scale, FP8_LIMIT, SOFT_ROUND), mask=mask)


def _launch_silu_mul(x2d: torch.Tensor, out2d: torch.Tensor) -> None:
    num_rows, width = x2d.shape
    assert width % 2 == 0, "last dim must be 2 * intermediate size"
    assert x2d.stride(1) == 1 and out2d.stride(1) == 1, "last dim must be contiguous"
    inter = width // 2
    if num_rows == 0 or inter == 0:
        return
    block = min(2048, triton.next_power_of_2(inter))
    num_warps = max(1, min(8, block // 256))
    grid = (num_rows, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](
        x2d, out2d, x2d.stride(0), out2d.stride(0), inter, BLOCK=block, num_warps=num_warps,
        **launch_options(x2d),
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] (gate | up) -> silu(gate) * up: [num_tokens, inter]."""
    inter = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)  # [..., inter]
    _launch_silu_mul(x2d, out.view(-1, inter))
    return out


def silu_mul_fp8(x: torch.Tensor, keep_values: bool = False) -> Fp8Rows:
    """As ``reference.silu_mul_fp8``: x [T, 2 * inter] -> Fp8Rows [T, inter] (with its values in
    x's dtype if ``keep_values``)."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_rows, width = x2d.shape
    assert width % 2 == 0, "last dim must be 2 * intermediate size"
    inter = width // 2
    codes = torch.empty((num_rows, inter), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    values = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device) if keep_values else None
    if num_rows and inter:
        block = min(4096, triton.next_power_of_2(inter))
        _silu_mul_fp8_kernel[(num_rows,)](
            x2d, codes, scale, codes if values is None else values, x2d.stride(0), codes.stride(0), inter,
            BLOCK=block, FP8_LIMIT=FP8_MAX, SOFT_ROUND=soft_round(), KEEP_VALUES=keep_values,
            num_warps=max(1, min(8, block // 512)), **launch_options(x2d),
        )
    elif num_rows:
        scale.fill_(1.0)
    return Fp8Rows(codes, scale, x.dtype, values)
