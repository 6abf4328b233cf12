"""SiLU-and-multiply of the gate/up projection (Triton).

    x = [gate | up]  (last dim 2 * inter)  ->  silu(gate) * up
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
