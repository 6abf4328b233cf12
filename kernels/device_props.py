"""What the launch rules read from the device: its number of SMs (cached per device)."""

from __future__ import annotations

from functools import cache

import torch


@cache
def _num_sms(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 4  # the interpreter: a few programs per wave keep the split paths tested
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.type == "cuda" else None)
