"""Per-token FP8 quantization of activations, Triton: the input of an FP8 tensor-core matmul.

    scale[m] = max_k |x[m, k]| / 448   (1 for a row of zeros),   q[m, k] = E4M3(x[m, k] / scale[m])

One program per row: a pass over the row for its amax, a second (from L1/L2) that
divides (IEEE, as the reference), clamps to +-448 and stores the E4M3 codes (rounded to
nearest, ties to even: the conversion instruction's cvt.rn.satfinite on a GPU). One read
of x and one write of a byte per element, where torch's form of the same math
(reference.quantize_rows_fp8) makes five passes. Launched without PDL: the
torch._scaled_mm after it waits for it as for any kernel.

The Triton interpreter (TRITON_INTERPRET=1, the CPU tests) converts fp32 to fp8 wrongly
(a carry out of the mantissa is dropped); there each value is first rounded onto the E4M3
grid in fp32 (``SOFT_ROUND``), after which its conversion is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_kv import soft_round
from tandem.kernels.fp8_weight import FP8_DTYPE, FP8_MAX


@triton.jit
def _round_to_e4m3_grid(y):
    """fp32 y within +-448 -> the nearest E4M3 value, ties to even, still fp32 (SOFT_ROUND only)."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals: 2^-9 steps
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): 3 mantissa bits
    steps = tl.abs(y) / step  # exact (a power of two), below 16
    rounded = ((steps + 12582912.0) - 12582912.0) * step  # + 1.5 * 2^23 rounds to an integer, ties to even
    return tl.where(bits < 0, -rounded, rounded)  # the sign bit: -0.0 stays -0.0


@triton.jit
def row_scale(row_max, FP8_LIMIT: tl.constexpr):
    """A row's scale from its amax (1 for a row of zeros). Shared with the kernels that quantize
    their own output (kernels.rms_norm, kernels.activation): the same math in each."""
    return tl.where(row_max > 0, tl.math.div_rn(row_max, FP8_LIMIT), 1.0)


@triton.jit
def to_codes(x, scale, FP8_LIMIT: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Values of a row (any float dtype) and its scale -> their E4M3 codes: the IEEE quotient,
    clamped, rounded to nearest even."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -FP8_LIMIT), FP8_LIMIT)
    if SOFT_ROUND:
        y = _round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, FP8_LIMIT: tl.constexpr,
                          BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + m * stride_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0), FP8_LIMIT)
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0)
        tl.store(q_ptr + m * stride_qm + k0 + cols, to_codes(x, scale, FP8_LIMIT, SOFT_ROUND), mask=mask)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] with contiguous rows -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32), as reference.quantize_rows_fp8."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows"
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    block = min(4096, triton.next_power_of_2(max(K, 16)))
    _quantize_rows_kernel[(M,)](
        x, q, scale, K, x.stride(0), q.stride(0), FP8_LIMIT=FP8_MAX, BLOCK=block,
        SOFT_ROUND=soft_round(),
        num_warps=max(1, min(8, block // 512)),
    )
    return q, scale
