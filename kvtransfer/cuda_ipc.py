"""``cuda_ipc`` transport: the decode worker's GPU KV pool mapped into the prefill worker.

The decode worker exports its pool once: the CUDA IPC handle of the pool's
storage (``cudaIpcGetMemHandle`` through torch's ``_share_cuda_``) plus the
layout, all plain bytes and ints, so it travels in a msgpack message. A
prefill worker on the same host maps it once and copies each finished
chunk's blocks straight into the destination blocks on its own CUDA stream,
then records an event. ``Transfer.done()`` is that event's ``query()``: the
prefill worker sends PrefillDone only after every copy has completed on the
device, so the decode worker never reads a block before its bytes are there.

Between two GPUs of one host the mapping works where peer access exists; the
copy then goes source gather -> peer copy -> destination scatter.
"""

from __future__ import annotations

import torch

from tandem.kernels import ops
from tandem.kvtransfer.base import Connection, Transfer, TransferError, Transport

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": torch.float8_e4m3fn}


class EventTransfer(Transfer):
    def __init__(self, event: torch.cuda.Event):
        self._event = event

    def done(self) -> bool:
        return self._event.query()


class CudaIpcConnection(Connection):
    def __init__(self, dst_kv: torch.Tensor):
        self._dst_kv = dst_kv  # [L, 2, N, bs, H, D] on the decode worker's device
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def write(self, src_kv: torch.Tensor, src_block_ids: list[int], dst_block_ids: list[int],
              handoff_id: str | None = None) -> Transfer:
        if self._dst_kv is None:
            raise TransferError("the connection to this decode worker's pool is closed (the worker restarted)")
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
        dst_kv = self._dst_kv
        if src_kv.shape[:2] != dst_kv.shape[:2] or src_kv.shape[3:] != dst_kv.shape[3:] or src_kv.dtype != dst_kv.dtype:
            raise TransferError(f"pool layouts differ: {tuple(src_kv.shape)} {src_kv.dtype} vs "
                                f"{tuple(dst_kv.shape)} {dst_kv.dtype}")
        stream = self._stream(src_kv.device)
        # the chunk's K/V were written on the compute stream: copy after them
        stream.wait_stream(torch.cuda.current_stream(src_kv.device))
        with torch.cuda.stream(stream):
            src = torch.tensor(src_block_ids, dtype=torch.long).to(src_kv.device, non_blocking=True)
            staging = ops.gather_blocks(src_kv, src)  # [L, 2, n, bs, H, D]
            if dst_kv.device != src_kv.device:
                staging = staging.to(dst_kv.device, non_blocking=True)
            with torch.cuda.device(dst_kv.device):
                dst = torch.tensor(dst_block_ids, dtype=torch.long).to(dst_kv.device, non_blocking=True)
                ops.scatter_blocks(dst_kv, dst, staging)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dst_kv.device))
        # keep the staging buffer alive until the copy is done
        staging.record_stream(torch.cuda.current_stream(dst_kv.device))
        return EventTransfer(event)


    def close(self) -> None:
        """Drop the mapping of the peer's pool (a dead decode worker's GPU memory is freed only
        once no process maps it); copies already queued keep their own references."""
        self._dst_kv = None


class CudaIpcTransport(Transport):
    name = "cuda_ipc"

    def export_pool(self, pool, rank_pools=()) -> dict:
        if rank_pools:
            raise TransferError(f"the {self.name} transport moves one pool; a split model's (--tensor-parallel-size "
                                "above 1) hands KV over with the shm transport only, for now")
        kv = pool.kv
        if not kv.is_cuda:
            raise TransferError("the cuda_ipc transport needs a KV pool on a CUDA device")
        storage = kv.untyped_storage()
        (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
            storage._share_cuda_()
        )
        return {
            "transport": self.name,
            "device": int(device),
            "handle": bytes(handle),
            "size_bytes": int(size_bytes),
            "offset_bytes": int(offset_bytes),
            "ref_handle": bytes(ref_handle),
            "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle else b"",
            "event_sync": bool(event_sync),
            "storage_offset": int(kv.storage_offset()),
            "shape": list(kv.shape),
            "dtype": str(kv.dtype).removeprefix("torch."),
            "kv_format": pool.kv_format(),
        }

    def connect(self, endpoint: dict) -> Connection:
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                endpoint["device"], endpoint["handle"], endpoint["size_bytes"], endpoint["offset_bytes"],
                endpoint["ref_handle"], endpoint["ref_offset"], endpoint["event_handle"] or None,
                endpoint["event_sync"],
            )
            dtype = _DTYPES[endpoint["dtype"]]
            kv = torch.empty(0, dtype=dtype, device=torch.device("cuda", endpoint["device"]))
            shape = endpoint["shape"]
            strides, step = [], 1
            for dim in reversed(shape):
                strides.insert(0, step)
                step *= dim
            kv.set_(storage, endpoint["storage_offset"], shape, strides)
        except (RuntimeError, KeyError, TypeError) as exc:
            raise TransferError(f"cannot map peer KV pool over CUDA IPC: {exc}") from exc
        return CudaIpcConnection(kv)
