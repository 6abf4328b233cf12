"""The device allocator's counters, for the worker's statistics lines.

A step whose temporaries do not fit the caching allocator's free blocks makes it ask the
driver for memory (``cuda_mallocs``); when the driver has none left it frees every cached
block and retries (``alloc_retries``), which synchronizes the device: the steps queued behind
run late and the host waits. Read every statistics interval (``cluster.step_stats``), their
rise says whether a slow interval paid for allocation.
"""

from __future__ import annotations

import torch


def allocator_counters(device: torch.device) -> dict[str, int]:
    """Cumulative counts of ``device``'s caching allocator: none off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"cuda_mallocs": int(stats.get("num_device_alloc", 0)),
            "cuda_frees": int(stats.get("num_device_free", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0))}
