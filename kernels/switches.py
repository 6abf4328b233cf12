"""The kernel tuning switches: what an A/B or a tuning run changes in the kernels' launch rules.

Not operator settings (those are ``tandem.cluster.settings``, one object with flags): every
default below is a measured rule (docs/kernels.md), and a switch replaces one of them so
that the alternative can be measured against it. Each is an environment variable
``TANDEM_<NAME>`` (the same rule as the settings' variables), read when first needed and
kept for the process (``current()``; ``reload()`` reads them again, for tests). Code never
assigns another module's globals to switch a kernel: a tuning run passes its choice to the
launcher as an argument, or sets these variables for the process it measures.

| variable | values (default first) | what it switches |
|---|---|---|
| TANDEM_KERNELS | triton, reference | reference: every op on its torch reference, on CUDA too |
| TANDEM_GEMV | 1, 0 | 0: small batches' projections on cuBLAS instead of the Triton GEMV / skinny GEMM |
| TANDEM_FUSED_ROTARY | auto, 0, 1 | rotary and the KV write inside decode attention (auto: small batches) |
| TANDEM_PDL | 1, 0 | 0: no programmatic dependent launch (sm90+) |
| TANDEM_DECODE_TILE | (the rule), BLOCK_N,num_warps,num_stages | decode attention's tile |
| TANDEM_FP8_SKINNY_MAX_ROWS | (the rule) | FP8 weights: the weight-only skinny GEMM up to this many rows |
| TANDEM_FP8_TENSOR_SKINNY_MAX_ROWS | (the rule) | FP8 weights: the tensor-core skinny GEMM up to this many rows |
| TANDEM_FUSED_FP8_QUANT | 1, 0 | 0: FP8 projections quantize their input themselves instead of the norm or SiLU·mul before them |
| TANDEM_FP8_QK_SCORES | (the rule), 0, 1 | an FP8 cache's decode attention scores from an E4M3 product (decode_attention's FP8_QK) or not |

Torch-free (``tandem config`` prints them).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

PREFIX = "TANDEM_"


@dataclass(frozen=True)
class KernelSwitches:
    kernels: str = "triton"
    gemv: bool = True
    fused_rotary: str = "auto"
    pdl: bool = True
    decode_tile: tuple[int, int, int] | None = None  # None: the rule's (tandem.kernels.decode_config)
    fp8_skinny_max_rows: int | None = None  # None: fp8_matmul.FP8_SKINNY_MAX_ROWS
    fp8_tensor_skinny_max_rows: int | None = None  # None: fp8_matmul.FP8_TENSOR_SKINNY_MAX_ROWS
    fused_fp8_quant: bool = True  # ops.quantizes_input
    fp8_qk_scores: bool | None = None  # None: decode_config.FP8_QK_SCORES

    @classmethod
    def from_env(cls) -> KernelSwitches:
        """The switches this process's environment sets; a bad value raises ValueError naming its variable."""
        values = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(env_name(f.name), "").strip()
            if raw:
                values[f.name] = _parse(f.name, raw)
        return cls(**values)


def env_name(name: str) -> str:
    return PREFIX + name.upper()


def _parse(name: str, raw: str):
    var = env_name(name)
    if name == "kernels":
        if raw not in ("triton", "reference"):
            raise ValueError(f"{var} must be triton or reference, not {raw!r}")
        return raw
    if name in ("gemv", "pdl", "fused_fp8_quant", "fp8_qk_scores"):
        if raw not in ("0", "1"):
            raise ValueError(f"{var} must be 0 or 1, not {raw!r}")
        return raw == "1"
    if name == "fused_rotary":
        if raw not in ("auto", "0", "1"):
            raise ValueError(f"{var} must be auto, 0 or 1, not {raw!r}")
        return raw
    if name == "decode_tile":
        return parse_tile(raw)
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"{var} must be a number of rows >= 0, not {raw!r}")
    return rows


def parse_tile(value: str) -> tuple[int, int, int]:
    """``BLOCK_N,num_warps,num_stages`` of decode attention, checked."""
    try:
        block_n, num_warps, num_stages = (int(x) for x in value.split(","))
    except ValueError:
        block_n = num_warps = num_stages = 0
    if not (block_n >= 16 and block_n & (block_n - 1) == 0 and num_warps in (1, 2, 4, 8, 16) and num_stages >= 1):
        raise ValueError(f"TANDEM_DECODE_TILE must be BLOCK_N,num_warps,num_stages (BLOCK_N a power of 2 >= 16, "
                         f"num_warps a power of 2 <= 16, num_stages >= 1), not {value!r}")
    return block_n, num_warps, num_stages


@functools.cache
def current() -> KernelSwitches:
    """This process's switches (read from the environment once)."""
    return KernelSwitches.from_env()


def reload() -> KernelSwitches:
    """Read the environment again (tests that change a switch)."""
    current.cache_clear()
    return current()


def describe() -> str:
    """``tandem config``'s lines for the switches."""
    lines = ["kernel tuning (environment only; docs/kernels.md):"]
    try:
        switches = current()
        sources = {f.name: "env" if os.environ.get(env_name(f.name), "").strip() else "default"
                   for f in dataclasses.fields(KernelSwitches)}
    except ValueError as exc:
        return "\n".join(lines + [f"  {exc}"])
    for f in dataclasses.fields(KernelSwitches):
        value = getattr(switches, f.name)
        lines.append(f"  {env_name(f.name):<32} {'the rule' if value is None else str(value):<40} {sources[f.name]}")
    return "\n".join(lines)
