"""FP8 weights: E4M3 values with one fp32 scale per output channel.

    W[n, k] ≈ data[n, k] * scale[n]      data: float8_e4m3fn [N, K],  scale: fp32 [N]
    scale[n] = max_k |W[n, k]| / 448     (448: E4M3's largest finite value; 1 for an all-zero row)

A projection's weight is either a tensor (the model dtype) or an ``Fp8Weight``;
``tandem.kernels.ops`` dispatches on which. A fused weight (q/k/v, gate/up) is
quantized row by row like any other: one scale per output channel is one scale per
row of the fused [N, K] matrix, so fusing FP8 parts is concatenating their data and
their scales.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_ROWS_PER_CHUNK = 4096  # quantize_weight's fp32 temporaries: at most this many rows at a time


class Fp8Weight(NamedTuple):
    """An FP8 projection weight: ``data`` [N, K] float8_e4m3fn, ``scale`` [N] fp32 (per output row)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


class Fp8Rows(NamedTuple):
    """Activations already in the per-token FP8 form an FP8 matmul takes: ``codes`` [M, K]
    float8_e4m3fn, ``scale`` [M, 1] fp32 (row m ≈ codes[m] * scale[m]), standing for [M, K]
    activations of ``dtype``. A kernel before the matmul (the RMSNorm, SiLU·mul) writes this form
    instead of its output, so the matmul's own quantization pass is not run (``kernels.ops``:
    ``quantize_for``). The dispatch rules read its shape, strides, dtype and device as those of
    the activations it stands for."""

    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    values: torch.Tensor | None = None  # the rows in ``dtype`` too, where another kernel reads them (LoRA)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def is_cuda(self) -> bool:
        return self.codes.is_cuda

    def dim(self) -> int:
        return self.codes.dim()

    def stride(self, dim: int | None = None):
        return self.codes.stride() if dim is None else self.codes.stride(dim)


def in_model_dtype(x):
    """Activations as a kernel that reads them in the model's dtype takes them: an ``Fp8Rows``'
    ``values`` (kept for it), any other tensor as it is."""
    if isinstance(x, Fp8Rows):
        if x.values is None:
            raise ValueError("these rows were quantized without their values")
        return x.values
    return x


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M] fp32) with x[m] ≈ q[m] * scale[m]:
    scale = amax(|x[m]|) / 448 (1 for a row of zeros), q = x / scale rounded to nearest even.
    The math of both weight quantization and the per-token activation quantization
    (``reference.quantize_rows_fp8``, the contract of ``kernels.fp8_quant``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1) if x.shape[-1] else torch.zeros(x.shape[:-1], device=x.device)
    # a tensor divisor: torch divides by a Python number as a multiply by its reciprocal on CUDA,
    # an ulp from the IEEE quotient the kernels (kernels.fp8_quant) compute
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """A [N, K] weight of any float dtype -> its per-row FP8 form (fp32 temporaries a chunk of rows at a time)."""
    assert weight.dim() == 2, "a projection weight is [N, K]"
    data = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        data[rows], scale[rows] = quantize_rows(weight[rows])
    return Fp8Weight(data, scale)


def fuse(parts: list[Fp8Weight]) -> Fp8Weight:
    """[q; k; v] or [gate; up] of per-row FP8 parts: the rows and their scales, concatenated (exact)."""
    return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]))


def dequantize(weight: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale[:, None] computed in fp32 (exact E4M3 values times fp32 scales), then cast to ``dtype``.

    On the CPU the E4M3 values come from a 256-entry table (torch's own float8 conversion of
    every byte) indexed by the raw bytes: the same numbers, several times faster than
    torch's elementwise float8 cast there."""
    data, scale = weight
    if data.device.type == "cpu":
        dense = _cpu_values(data)
    else:
        dense = data.to(torch.float32)
    dense.mul_(scale.float()[:, None])
    return dense if dtype == torch.float32 else dense.to(dtype)


def _cpu_values(data: torch.Tensor) -> torch.Tensor:
    table = _E4M3_TABLE.numpy()
    return torch.from_numpy(table[data.contiguous().view(torch.uint8).numpy()])


# every E4M3 byte's value, in fp32 (torch's conversion): the CPU dequantization's lookup table
_E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
