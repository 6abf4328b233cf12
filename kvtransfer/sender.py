"""Prefill side of one request's handoff.

Lifecycle: BOOTSTRAPPING (no connection yet) -> WAITING_FOR_INPUT (connected,
idle) <-> TRANSFERRING (writes in flight) -> SUCCESS (``finish()`` called and
every write done) | FAILED (a write or the connection failed, and no write is still in
flight: until then a failed handoff reads TRANSFERRING). A write that raises
anything fails the handoff, never the prefill worker.
"""

from __future__ import annotations

import torch

from tandem.kvtransfer.base import Connection, KVPoll, Transfer, TransferError


def pool_num_blocks(endpoint: dict) -> int | None:
    """How many blocks the pool an endpoint names has, where the endpoint says (shm and nccl:
    its layout; cuda_ipc: the pool's shape [L, 2, N, ...]); None when it does not."""
    layout, shape = endpoint.get("layout"), endpoint.get("shape")
    count = layout.get("num_blocks") if isinstance(layout, dict) else (
        shape[2] if isinstance(shape, list) and len(shape) > 2 else None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def kv_format_mismatch(endpoint: dict, pool) -> str | None:
    """Why blocks of ``pool`` (this prefill worker's) may not be written into the pool an endpoint
    names, or None: the endpoint's ``kv_format`` (``KVCachePool.kv_format``: dtype, FP8 scales'
    digest) must be this pool's, since blocks travel as bytes. An endpoint that describes no
    format is left to the transports' own checks (they compare dtypes on every write)."""
    theirs = endpoint.get("kv_format")
    if not isinstance(theirs, dict):
        return None
    ours = pool.kv_format()
    if theirs.get("dtype") != ours["dtype"]:
        return (f"the decode worker's KV cache holds {theirs.get('dtype')}, this prefill worker's "
                f"{ours['dtype']}: give every worker the same --kv-cache-dtype and --dtype")
    if theirs.get("scales") != ours["scales"]:
        return (f"the decode worker's FP8 KV scales (digest {theirs.get('scales')}) differ from this "
                f"prefill worker's ({ours['scales']}): every worker must load the same checkpoint "
                "(calibrated scales: on the same kind of device)")
    return None


class KVSender:
    def __init__(self, connection: Connection | None, dst_block_ids: list[int], handoff_id: str | None = None):
        self._connection = connection
        self._handoff_id = handoff_id
        self._dst_block_ids = dst_block_ids
        self._in_flight: list[Transfer] = []
        self._finished = False
        self.error: str | None = None

    def send_blocks(self, src_kv: torch.Tensor, src_block_ids: list[int], first_block_index: int) -> None:
        """Write source blocks into destination blocks ``first_block_index`` onward."""
        if self._connection is None or self.error is not None:
            return
        end = first_block_index + len(src_block_ids)
        if end > len(self._dst_block_ids):
            self._fail(f"chunk needs destination block {end - 1}, only {len(self._dst_block_ids)} reserved")
            return
        try:
            self._in_flight.append(
                self._connection.write(src_kv, src_block_ids, self._dst_block_ids[first_block_index:end],
                                       self._handoff_id)
            )
        except Exception as exc:  # TransferError, or a copy's own error (an index the pool lacks)
            self._fail(str(exc) if isinstance(exc, TransferError) else f"KV write failed: {exc!r}")

    def finish(self) -> None:
        """No more blocks will be sent."""
        self._finished = True

    def poll(self) -> KVPoll:
        """FAILED only once no write is in flight: a failed handoff's earlier writes may still land
        in the destination blocks, and PrefillDone (which hands them back) must come after them."""
        if self._connection is None and self.error is None:
            return KVPoll.BOOTSTRAPPING
        pending = []
        for transfer in self._in_flight:
            try:
                if not transfer.done():
                    pending.append(transfer)
            except Exception as exc:  # this write is over (failed); the others still count
                self.error = self.error or str(exc)
        self._in_flight = pending
        if pending:
            return KVPoll.TRANSFERRING
        if self.error is not None:
            return KVPoll.FAILED
        return KVPoll.SUCCESS if self._finished else KVPoll.WAITING_FOR_INPUT

    def _fail(self, error: str) -> None:
        self.error = error  # writes already in flight are still waited for (poll)
