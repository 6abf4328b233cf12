"""Bulk L2 prefetch (sm90): ask the L2 for a contiguous byte range without waiting for it.

A kernel that waits for its predecessor (kernels.pdl) can name the weight bytes it
will read before the wait: the memory system fetches them while the predecessor's
last programs still run, when the HBM is otherwise idle, and the loads after the
wait hit the L2. ``cp.async.bulk.prefetch.L2.global [addr], size`` is a hint: it
has no result and changes no value, so a prefetch cannot change an output.

Needs sm90 or later and a compiled kernel (not the Triton interpreter): launchers
ask ``supported`` before setting their ``L2_PREFETCH`` constexpr.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """For each pointer p of ``ptrs`` (a block): prefetch bytes [p, p + nbytes) into the L2.
    p must be 16-byte aligned and nbytes a multiple of 16 (the instruction's rules)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [ptrs, nbytes + tl.zeros(ptrs.shape, tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@cache
def _device_ok(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def supported(tensor: torch.Tensor) -> bool:
    """Whether kernels reading ``tensor`` may prefetch: CUDA, sm90+, compiled (not interpreted)."""
    if not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return _device_ok(index)
