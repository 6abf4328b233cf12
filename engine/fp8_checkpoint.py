"""FP8 checkpoints' tensors as tandem's FP8 weights (E4M3 rows, one fp32 scale per output row).

A checkpoint in the compressed-tensors or transformers' fp8 format (``cluster.quantization``)
stores each quantized weight as float8_e4m3fn beside its scale tensor
(``<module>.weight_scale`` or ``<module>.weight_scale_inv``):

- per channel ([N] or [N, 1]) or per tensor ([1] or []): already tandem's form (a tensor
  scale is every row's), taken as it is: exact;
- in blocks ([cdiv(N, bn), cdiv(K, bk)] for the scheme's [bn, bk] blocks): dequantized
  and quantized again per row (``fp8_weight.quantize_weight``), which rounds each value
  once more, onto its row's E4M3 grid.

Static activation scales (``input_scale``) and FP8 KV-cache scales (``k_scale``,
``v_scale``, ``output_scale``) are dropped: tandem quantizes activations per token from
their own values and keeps its KV cache in its own dtype.
"""

from __future__ import annotations

import torch

from tandem.cluster.quantization import CheckpointFp8
from tandem.kernels.fp8_weight import FP8_DTYPE, Fp8Weight, quantize_weight

_UNUSED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")


def read_fp8_weights(tensors: dict[str, torch.Tensor], scheme: CheckpointFp8) -> dict[str, torch.Tensor | Fp8Weight]:
    """The checkpoint's tensors under their own names, each quantized ``X.weight`` and its scale
    as one per-row ``Fp8Weight``; weights the checkpoint left unquantized stay tensors."""
    suffix = "." + scheme.scale_suffix
    out: dict[str, torch.Tensor | Fp8Weight] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(suffix):
            scales[name[: -len(suffix)] + ".weight"] = tensor
        elif not name.endswith(_UNUSED_SUFFIXES):
            out[name] = tensor
    for name, scale in scales.items():
        if name not in out:
            raise ValueError(f"checkpoint has {name.removesuffix('.weight')}{suffix} but no {name}")
        out[name] = per_row(name, out[name], scale, scheme.block)
    unscaled = [n for n, t in out.items() if isinstance(t, torch.Tensor) and t.dtype == FP8_DTYPE]
    if unscaled:
        raise ValueError(f"checkpoint's float8 tensor {unscaled[0]!r} has no {scheme.scale_suffix}")
    return out


def per_row(name: str, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> Fp8Weight:
    """One checkpoint weight [N, K] (float8_e4m3fn) and its scale -> the per-row form."""
    if data.dtype != FP8_DTYPE or data.dim() != 2:
        raise ValueError(f"{name}: a {data.dtype} tensor of shape {list(data.shape)} has a scale; "
                         "tandem reads float8_e4m3fn [N, K] weights")
    N, K = data.shape
    scale = scale.to(torch.float32)
    if block is not None and scale.dim() == 2 and scale.shape == (-(-N // block[0]), -(-K // block[1])):
        expanded = scale.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
        return quantize_weight(data.to(torch.float32) * expanded)
    if scale.numel() == 1:
        return Fp8Weight(data, scale.reshape(1).expand(N).contiguous())
    if scale.numel() == N and scale.shape in ((N,), (N, 1)):
        return Fp8Weight(data, scale.reshape(N).contiguous())
    raise ValueError(f"{name}: a scale of shape {list(scale.shape)} is neither per tensor, per channel "
                     f"nor per {list(block) if block else 'block'} block of a {[N, K]} weight")
