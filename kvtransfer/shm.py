"""``shm`` transport: the decode worker's KV pool is a shared-memory file.

The decode worker creates its pool with ``KVCachePool.create_shared`` and
exports the file path and layout; a prefill worker maps the same file once and
copies each finished chunk's blocks straight into the destination blocks. The
copy is synchronous (CPU memcpy), so every transfer is complete on return.
"""

from __future__ import annotations

import torch

from tandem.kernels import ops
from tandem.kvtransfer.base import CompletedTransfer, Connection, Transfer, TransferError, Transport


class ShmConnection(Connection):
    def __init__(self, pool):
        self._pool = pool

    def write(self, src_kv: torch.Tensor, src_block_ids: list[int], dst_block_ids: list[int],
              handoff_id: str | None = None) -> Transfer:
        if self._pool is None:
            raise TransferError("the connection to this decode worker's pool is closed (the worker restarted)")
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
        dst_kv = self._pool.kv
        if src_kv.shape[:2] != dst_kv.shape[:2] or src_kv.shape[3:] != dst_kv.shape[3:] or src_kv.dtype != dst_kv.dtype:
            raise TransferError(f"pool layouts differ: {tuple(src_kv.shape)} {src_kv.dtype} vs "
                                f"{tuple(dst_kv.shape)} {dst_kv.dtype}")
        src = torch.tensor(src_block_ids, dtype=torch.long)
        dst = torch.tensor(dst_block_ids, dtype=torch.long)
        ops.scatter_blocks(dst_kv, dst, ops.gather_blocks(src_kv, src))
        return CompletedTransfer()

    def close(self) -> None:
        """Unmap the peer's pool file (its RAM goes back once every process has let it go)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class ShmTransport(Transport):
    name = "shm"

    def export_pool(self, pool) -> dict:
        if pool.shm_path is None:
            raise TransferError("the shm transport needs a KV pool created with KVCachePool.create_shared")
        return {"transport": self.name, "path": pool.shm_path, "layout": pool.layout(), "kv_format": pool.kv_format()}

    def connect(self, endpoint: dict) -> Connection:
        from tandem.engine.kv_cache import KVCachePool

        try:
            pool = KVCachePool.attach_shared(endpoint["path"], **endpoint["layout"])
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            raise TransferError(f"cannot map peer KV pool {endpoint.get('path')}: {exc}") from exc
        return ShmConnection(pool)
