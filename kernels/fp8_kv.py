"""FP8 (E4M3) KV-cache values in the kernels: what a KV write stores.

An FP8 KV pool (``torch.float8_e4m3fn``) holds x / scale rounded to E4M3 (to nearest, ties
to even) and clamped to +-448 (E4M3 has no infinity: a value past the range saturates), one
fp32 scale per layer and KV head (``tandem.engine.kv_scales``); ``reference.quantize_kv_fp8`` is
the contract. The division is IEEE (``div_rn``), as torch's, so a kernel stores the
reference's codes bit for bit. The attention kernels widen the codes to their dot's dtype
(exact: every E4M3 value is a bf16, fp16 and fp32 value) and apply the scale to the scores
(K) and to the output (V): a program reads one KV head, whose scale is one number.

The Triton interpreter (TRITON_INTERPRET=1, the CPU tests) converts fp32 to fp8 wrongly (a
carry out of the mantissa is dropped, ties round away from zero); there the value is first
rounded onto the E4M3 grid in fp32 (``SOFT_ROUND``), after which the conversion is exact. On
a GPU the conversion instruction rounds (``cvt.rn.satfinite``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.kernels.reference import KV_FP8_DTYPE


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == KV_FP8_DTYPE


def soft_round() -> bool:
    """Whether fp32 -> fp8 is rounded in fp32 first: under the interpreter only."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_scales(cache: torch.Tensor, k_scale, v_scale, num_kv_heads: int):
    """-> (k_scale, v_scale) to pass to a kernel: the FP8 cache's [num_kv_heads] fp32 scales, checked;
    for any other cache (which has none) the cache itself, never read."""
    if not is_fp8(cache):
        return cache, cache
    assert k_scale is not None and v_scale is not None, "an FP8 KV cache needs its k_scale and v_scale"
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s.shape == (num_kv_heads,) and s.dtype == torch.float32 and s.stride(0) == 1, \
            f"{name}: [num_kv_heads] contiguous fp32"
        assert s.device == cache.device, f"{name} is on {s.device}, the cache on {cache.device}"
    return k_scale, v_scale


@triton.jit
def _round_to_e4m3(y):
    """fp32 y within +-448 -> the nearest E4M3 value (ties to even), still in fp32."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6: the subnormals' step, 2^-9
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(y) * inv_step  # exact: a power of two; t < 16
    r = ((t + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: the sum rounds t to an integer, ties to even
    return tl.where(bits < 0, -r, r)  # the sign of -0.0 too


@triton.jit
def quantize_kv_fp8(x, scale, SOFT_ROUND: tl.constexpr):
    """E4M3 codes of x / scale (any float x; fp32 scale broadcastable to it), clamped to +-448."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if SOFT_ROUND:
        y = _round_to_e4m3(y)
    return y.to(tl.float8e4nv)
