"""Programmatic dependent launch (PDL; Hopper and later) for the kernels of a decode step.

A decode step at a small batch is a chain of ~300 short kernels, and between two
of them the GPU idles while the next grid launches and its programs ramp up.
Launched with PDL, a kernel's programs may start while its predecessor's last
programs still run. Each of our kernels therefore first lets its successor launch
(``gdc_launch_dependents``), does the work that needs nothing from its
predecessor (a GEMV's first weight tile), then waits until the predecessor has
finished and its writes are visible (``gdc_wait``) before it reads or writes any
activation. Every program waits, so no kernel completes before its predecessor:
a kernel two back has finished too. A kernel launched without PDL (torch's, cuBLAS)
waits for the whole stream as usual.

Off on the CPU, under the Triton interpreter, before sm90 and with TANDEM_PDL=0.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from tandem.kernels import switches

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options"]


@cache
def _enabled(device_index: int) -> bool:
    if gdc_wait is None or not switches.current().pdl or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(tensor: torch.Tensor) -> dict:
    """Extra launch keywords for a kernel with a ``USE_PDL`` constexpr: {} where PDL is off."""
    if not tensor.is_cuda:
        return {}
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return {"USE_PDL": True, "launch_pdl": True} if _enabled(index) else {}
