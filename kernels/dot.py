"""The matrix product both attention kernels use, with the interpreter's bf16 workaround.

The interpreter (TRITON_INTERPRET=1, CPU tests) multiplies bf16 operands as raw
uint16 bits; there the operands are widened to fp32 first, which is exact for
bf16 x bf16 products and so matches the GPU's bf16 MMA with fp32 accumulation.
"""

import os

import torch
import triton
import triton.language as tl


def upcast_bf16_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
