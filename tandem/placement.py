"""Where `tandem serve` puts each worker on this machine's GPUs (torch-free).

Colocated pools (``--pools colocated``, or auto where the pools would share a device):
one worker per ``--num-decode-workers`` runs both pools (``tandem.colocated``), each on a
GPU of its own where there are several. Separate pools:

One GPU (or none): every worker shares it; the handoff is cuda_ipc (shm on the
CPU). Two or more: prefill workers take the first half of the GPUs and decode
workers the rest, round robin within each half, each process seeing only its
own GPU (CUDA_VISIBLE_DEVICES); CUDA IPC handles do not cross that isolation,
so the handoff is nccl. An explicit --kv-transport always wins.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


@dataclass
class Placement:
    role: str
    index: int
    env: dict[str, str] = field(default_factory=dict)
    kv_transport: str | None = None  # None: keep the settings' value


def count_gpus() -> int:
    """GPUs visible to this process, without importing torch (nvidia-smi; 0 when absent)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def colocated(pools: str, num_gpus: int, device: str, tp_size: int = 1) -> bool:
    """Whether one worker runs both pools: asked for, or (auto) the pools would share a device,
    or the model is split over ranks (``tp_size``: a split model's pools are colocated)."""
    if pools != "auto":
        return pools == "colocated"
    return device == "cpu" or device.startswith("cuda:") or num_gpus < 2 or tp_size > 1


def plan(num_gpus: int, device: str, kv_transport: str, num_prefill: int, num_decode: int,
         pools: str = "separate", tp_size: int = 1) -> list[Placement]:
    """One Placement per worker: prefill workers first, then decode workers; with colocated pools,
    ``num_decode`` workers that each run both, ``tp_size`` GPUs each (one per rank) where there
    are several."""
    if colocated(pools, num_gpus, device, tp_size):
        workers = [Placement("colocated", i) for i in range(num_decode)]
        if device != "cpu" and not device.startswith("cuda:") and num_gpus >= 2:
            ids = _visible_ids(num_gpus)
            if tp_size * num_decode > len(ids):
                raise ValueError(f"{num_decode} workers of --tensor-parallel-size {tp_size} need "
                                 f"{tp_size * num_decode} GPUs; {len(ids)} are visible")
            for worker in workers:
                start = worker.index * tp_size % len(ids)
                worker.env = {"CUDA_VISIBLE_DEVICES": ",".join(ids[start : start + tp_size])}
        return workers
    workers = [Placement("prefill", i) for i in range(num_prefill)] + [Placement("decode", i) for i in range(num_decode)]
    if device == "cpu" or device.startswith("cuda:") or num_gpus < 2:
        return workers
    ids = _visible_ids(num_gpus)
    half = max(len(ids) // 2, 1)
    prefill_gpus, decode_gpus = ids[:half], ids[half:]
    for worker in workers:
        gpus = prefill_gpus if worker.role == "prefill" else decode_gpus
        worker.env = {"CUDA_VISIBLE_DEVICES": gpus[worker.index % len(gpus)]}
        if kv_transport == "auto":
            worker.kv_transport = "nccl"
    return workers


def _visible_ids(num_gpus: int) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(num_gpus)]
