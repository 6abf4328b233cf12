"""FP8 tensor-core matmuls for FP8 weights past the skinny GEMM: prefill, large decode batches.

    y = (q_x * s_x) (w * s_w)^T = (q_x w^T) * s_x s_w^T      q_x, w: E4M3;  s_x [M, 1], s_w [1, N]: fp32

x is quantized per token (``ops.quantize_rows_fp8``: one scale per row, computed from
the row itself, so no calibration) and multiplied with the per-output-channel FP8
weight on the FP8 tensor cores by ``torch._scaled_mm`` with row-wise scales
(cuBLASLt / CUTLASS; bf16 out). That form runs on sm89 and later for bf16 activations
with K and N multiples of 16; anything else takes the weight dequantized instead
(``ops._matmul``).
"""

from __future__ import annotations

from functools import cache

import torch

from tandem.kernels import switches
from tandem.kernels.fp8_weight import Fp8Weight


@cache
def _device_has_fp8_mma(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def takes(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether ``scaled_mm`` runs this product: bf16 x [M, K] on a CUDA device with FP8 MMA
    (sm89+), K and N multiples of 16 (torch._scaled_mm's rule), x's and the weight's rows contiguous."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0
            and hasattr(torch, "_scaled_mm")):
        return False
    num_out, K = weight.shape
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return (K % 16 == 0 and num_out % 16 == 0 and x.shape[1] == K and x.stride(1) == 1
            and weight.data.stride(1) == 1 and _device_has_fp8_mma(index))


def scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """x_q [M, K] E4M3 with x_scale [M, 1] fp32, weight [N, K] -> (x_q W^T) * x_scale * scale^T (+ bias):
    [M, N] in ``out_dtype`` (bf16). The weight's [N, K] rows are the column-major [K, N] operand
    torch._scaled_mm wants, as they are (no copy)."""
    y = torch._scaled_mm(x_q, weight.data.t(), scale_a=x_scale, scale_b=weight.scale.view(1, -1),
                         out_dtype=out_dtype)
    return y if bias is None else y.add_(bias)


# FP8 weights take the weight-only skinny GEMM (E4M3 widened to x's dtype in registers) up to this
# many rows, FP8 tensor cores past them. One H200, 2026-12-02, llama3-8b's projections per step
# (python3 -m tandem.bench.tune_fp8 --parts skinny; docs/kernels.md): at 16 rows weight-only 3.63 ms
# at its best tiles (bf16 skinny 3.84), the tensor-core skinny GEMM with x quantized first 2.81,
# torch's scaled matmul 4.44; at 64 rows 6.12, 3.11 and 4.28 (bf16 4.27). So from 2 rows on: the
# tensor-core skinny GEMM. Engine, same day (tandem bench engine --models llama3-8b --batches 1,16,64
# --quantization fp8): b16 6.873 -> 3.654 ms per step, b64 5.483 -> 4.259 (bf16 4.812, 5.211).
FP8_SKINNY_MAX_ROWS = 1


def fp8_skinny_max_rows() -> int:
    rows = switches.current().fp8_skinny_max_rows
    return FP8_SKINNY_MAX_ROWS if rows is None else rows


# Past fp8_skinny_max_rows(), FP8 weights take the skinny GEMM on FP8 tensor cores (x quantized per
# token) up to this many rows, torch's scaled matmul past them (0: the scaled matmul throughout).
# At 128 rows (the skinny GEMM's most; same sweep, --batches 128): 3.76 ms per step, torch's scaled
# matmul 4.03, bf16 cuBLAS 4.53. Past 128 rows: torch's scaled matmul, as for prefill.
FP8_TENSOR_SKINNY_MAX_ROWS = 128


def fp8_tensor_skinny_max_rows() -> int:
    rows = switches.current().fp8_tensor_skinny_max_rows
    return FP8_TENSOR_SKINNY_MAX_ROWS if rows is None else rows
