"""``shm`` transport: the decode worker's KV pool is a shared-memory file.

The decode worker creates its pool with ``KVCachePool.create_shared`` and
exports the file path and layout; a prefill worker maps the same file once and
copies each finished chunk's blocks straight into the destination blocks. The
copy is synchronous (CPU memcpy), so every transfer is complete on return.

Split models (``engine.tensor_parallel``): a worker of N ranks keeps each rank's pool (its
share of the KV heads) in a file of its own, and its leader maps its followers' files. A decode
worker of N ranks exports every rank's file with the first KV head it holds (``ranks``); a
prefill worker of M ranks writes from every rank's pool (``ModelRunner.handoff_kv``). Each source
part's heads go to the destination parts that hold them, whatever the two degrees.
"""

from __future__ import annotations

import torch

from tandem.kernels import ops
from tandem.kvtransfer.base import CompletedTransfer, Connection, Transfer, TransferError, Transport

HEADS = 4  # the KV heads' dimension of a pool tensor [layers, 2, blocks, block_size, heads, head_dim]


def as_parts(kv) -> list[tuple[torch.Tensor, int]]:
    """A pool tensor, or a split model's (tensor, first KV head) parts -> the parts."""
    return [(kv, 0)] if isinstance(kv, torch.Tensor) else list(kv)


class ShmConnection(Connection):
    def __init__(self, pools: list[tuple[object, int]]):
        self._pools = pools  # (a mapped KVCachePool, the first KV head it holds)

    def write(self, src_kv, src_block_ids: list[int], dst_block_ids: list[int],
              handoff_id: str | None = None) -> Transfer:
        """``src_kv``: the source pool's tensor, or a split model's parts (``as_parts``)."""
        if self._pools is None:
            raise TransferError("the connection to this decode worker's pool is closed (the worker restarted)")
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
        sources, targets = as_parts(src_kv), [(pool.kv, first) for pool, first in self._pools]
        self._check(sources, targets)
        src = torch.tensor(src_block_ids, dtype=torch.long)
        dst = torch.tensor(dst_block_ids, dtype=torch.long)
        for src_part, src_first in sources:
            blocks = ops.gather_blocks(src_part, src)
            src_end = src_first + src_part.shape[HEADS]
            for dst_part, dst_first in targets:
                lo, hi = max(src_first, dst_first), min(src_end, dst_first + dst_part.shape[HEADS])
                if lo >= hi:
                    continue
                if (lo, hi) == (dst_first, dst_first + dst_part.shape[HEADS]) == (src_first, src_end):
                    ops.scatter_blocks(dst_part, dst, blocks)
                else:  # some of the heads: the destination's view of them
                    dst_part[:, :, dst, :, lo - dst_first : hi - dst_first] = blocks[..., lo - src_first : hi - src_first, :]
        return CompletedTransfer()

    @staticmethod
    def _check(sources, targets) -> None:
        def heads(parts):
            return sorted((first, first + t.shape[HEADS]) for t, first in parts)

        (ref, _), src_heads, dst_heads = targets[0], heads(sources), heads(targets)
        for t, _ in (*sources, *targets):
            if (t.shape[:2], t.shape[3], t.shape[5:], t.dtype) != (ref.shape[:2], ref.shape[3], ref.shape[5:], ref.dtype):
                raise TransferError(f"pool layouts differ: {tuple(t.shape)} {t.dtype} vs {tuple(ref.shape)} {ref.dtype}")
        if src_heads[0][0] != 0 or src_heads[-1][1] != dst_heads[-1][1] or dst_heads[0][0] != 0:
            raise TransferError(f"the pools hold different KV heads: {src_heads} vs {dst_heads}")

    def close(self) -> None:
        """Unmap the peer's pool files (their RAM goes back once every process has let them go)."""
        if self._pools is not None:
            for pool, _ in self._pools:
                pool.close()
            self._pools = None


class ShmTransport(Transport):
    name = "shm"

    def export_pool(self, pool, rank_pools=()) -> dict:
        """``rank_pools``: a split model's followers' pools (ranks 1..N-1), each holding the next
        ``pool.num_kv_heads`` KV heads."""
        pools = [pool, *rank_pools]
        if any(p.shm_path is None for p in pools):
            raise TransferError("the shm transport needs a KV pool created with KVCachePool.create_shared")
        endpoint = {"transport": self.name, "path": pool.shm_path, "layout": pool.layout(), "kv_format": pool.kv_format()}
        if rank_pools:
            endpoint["ranks"] = [{"path": p.shm_path, "layout": p.layout(), "first_head": rank * pool.num_kv_heads}
                                 for rank, p in enumerate(pools)]
        return endpoint

    def connect(self, endpoint: dict) -> Connection:
        from tandem.engine.kv_cache import KVCachePool

        ranks = endpoint.get("ranks") or [{"path": endpoint.get("path"), "layout": endpoint.get("layout"),
                                           "first_head": 0}]
        pools = []
        try:
            for rank in ranks:
                pools.append((KVCachePool.attach_shared(rank["path"], **rank["layout"]), int(rank["first_head"])))
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
            for pool, _ in pools:
                pool.close()
            raise TransferError(f"cannot map peer KV pool {endpoint.get('path')}: {exc}") from exc
        return ShmConnection(pools)
