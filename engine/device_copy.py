"""Small host tensors onto the device without making the host wait for the device.

A copy from pageable host memory (``torch.tensor(values, device="cuda")``, ``.to("cuda")``)
runs on the current stream and then waits for it: the host stops until every kernel already
queued there has run. The worker launches a step while the previous one runs, so such a copy
in a step's preparation (its block ids, its LoRA segments, its sampling parameters) costs the
whole queued step in host time and leaves the device idle while the host catches up. From
pinned memory the copy is asynchronous and ordered on the stream like a kernel; the caching
host allocator keeps the pinned buffer until the copy has run. ``tests/unit/test_device_copies``
keeps the synchronous form out of the engine and the workers.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: asynchronous from pinned memory on CUDA, itself on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without waiting for the device."""
    return to_device(torch.tensor(values, dtype=dtype), device)
