"""Which quantized checkpoints tandem serves, read from config.json's ``quantization_config`` (torch-free).

FP8 weights only: the ``compressed-tensors`` format with 8-bit float weights (per channel,
per tensor or in blocks: llm-compressor's FP8 and FP8_DYNAMIC schemes) and transformers'
``fp8`` format (E4M3 weights with ``weight_scale_inv`` scales per ``weight_block_size``
block, as DeepSeek-V3 and Qwen3-FP8 ship). Both are served as tandem's own FP8 weights
(per output channel; ``engine/fp8_checkpoint.py``). Any other quantization (GPTQ, AWQ,
bitsandbytes, integer compressed-tensors, ...) is refused in one line, here, so that the
CLI refuses it before any worker starts and the engine refuses it when it reads the config.
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("none", "fp8")  # --quantization
_REFUSAL = "serve the bf16/fp16/fp32 weights, or FP8 ones (compressed-tensors float8, or quant_method 'fp8')"
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("channel", "tensor", "block")


@dataclass(frozen=True)
class CheckpointFp8:
    """An FP8 checkpoint's scheme: the tensor holding each weight's scale and, for block scales,
    the block's [rows, columns]."""

    method: str  # "compressed-tensors" | "fp8"
    scale_suffix: str  # "weight_scale" (compressed-tensors) | "weight_scale_inv" (fp8)
    block: tuple[int, int] | None = None


def checkpoint_fp8(raw: dict) -> CheckpointFp8 | None:
    """None for an unquantized config; the FP8 scheme of one tandem loads; ValueError (one line) otherwise."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and not (len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            _refuse(method, f"weight_block_size {block!r}")
        return CheckpointFp8("fp8", "weight_scale_inv", tuple(block) if block is not None else None)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    _refuse(method)


def _compressed_tensors(qc: dict) -> CheckpointFp8:
    method = "compressed-tensors"
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        _refuse(method, f"format {fmt!r}")
    blocks = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            _refuse(method, f"{weights.get('num_bits')}-bit {weights.get('type')} weights in {name}")
        strategy = weights.get("strategy")
        if strategy not in _CT_STRATEGIES or not weights.get("symmetric", True) or weights.get("dynamic"):
            _refuse(method, f"{strategy} weight scales in {name}")
        if strategy == "block":
            block = weights.get("block_structure")
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) for b in block)):
                _refuse(method, f"block_structure {block!r} in {name}")
            blocks.add(tuple(block))
    if not blocks and not qc.get("config_groups"):
        _refuse(method, "no config_groups")
    if len(blocks) > 1:
        _refuse(method, f"several block structures {sorted(blocks)}")
    return CheckpointFp8(method, "weight_scale", blocks.pop() if blocks else None)


def _refuse(method: str, detail: str | None = None):
    what = f"quant_method={method!r}" + (f", {detail}" if detail else "")
    raise ValueError(f"quantized checkpoints ({what}) are not supported: {_REFUSAL}")
