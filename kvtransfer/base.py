"""Transport interface and the transfer status enum.

A transport has a receiving half (``export_pool``: the decode worker publishes
how to reach its KV pool, once) and a sending half (``connect``: the prefill
worker opens a connection to an exported pool, ``Connection.write`` starts
copying blocks and returns a ``Transfer`` whose ``done()`` is polled).
Ownership: the destination blocks belong to the decode worker throughout; the
prefill worker may write them only between receiving a PrefillJob and sending
its PrefillDone.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod

import torch


class KVPoll(enum.Enum):
    FAILED = "failed"
    BOOTSTRAPPING = "bootstrapping"  # connecting to the peer's pool
    WAITING_FOR_INPUT = "waiting_for_input"  # connected, no write in flight
    TRANSFERRING = "transferring"  # a write is in flight
    SUCCESS = "success"  # every block is in place


class TransferError(RuntimeError):
    pass


class Transfer(ABC):
    """One in-flight write of some blocks."""

    @abstractmethod
    def done(self) -> bool:
        """True once the bytes are in the destination; raises TransferError on failure."""


class CompletedTransfer(Transfer):
    def done(self) -> bool:
        return True


class Connection(ABC):
    @abstractmethod
    def write(
        self, src_kv: torch.Tensor, src_block_ids: list[int], dst_block_ids: list[int],
        handoff_id: str | None = None,
    ) -> Transfer:
        """Copy ``src_kv[:, :, src_block_ids]`` into the peer's ``[:, :, dst_block_ids]``;
        ``handoff_id`` names the grant the receiving side checks (transports that check one)."""

    def close(self) -> None:
        """Release the peer's pool (mapping, pair); writes after this raise TransferError."""


class Transport(ABC):
    name: str

    @abstractmethod
    def export_pool(self, pool, rank_pools=()) -> dict:
        """Receiving side: a msgpack-able endpoint map that lets a peer reach ``pool`` (and a split
        model's followers' ``rank_pools``: the shm transport's)."""

    @abstractmethod
    def connect(self, endpoint: dict) -> Connection:
        """Sending side: open a connection to an exported pool."""

    # whether ``revoke`` also stops a late write of a sender that is still running (the receiving
    # side applies every chunk itself); where not, the decode worker holds a given-up handoff's
    # blocks until the sender is done with them (decode.quarantine)
    revoke_stops_writes = False

    def grant(self, handoff_id: str, block_ids: list[int]) -> None:
        """Receiving side: chunks of this handoff may write these blocks (no-op where the
        receiving side applies nothing itself)."""

    def revoke(self, handoff_id: str) -> None:
        """Receiving side: the handoff is over; once this returns, none of its chunks
        writes the pool, so its blocks may be freed."""


_TRANSPORTS = {
    "shm": "tandem.kvtransfer.shm:ShmTransport",
    "cuda_ipc": "tandem.kvtransfer.cuda_ipc:CudaIpcTransport",
    "nccl": "tandem.kvtransfer.nccl:NcclTransport",
}


def get_transport(name: str, settings=None) -> Transport:
    """The transport ``name``; ``settings`` (tandem.cluster.settings.Settings): nccl's own
    (--kv-host, --kv-timeout-s, --kv-piece-bytes, --kv-trace)."""
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown kv transport {name!r}; choose one of {sorted(_TRANSPORTS)}")
    module, cls = _TRANSPORTS[name].split(":")
    transport = getattr(importlib.import_module(module), cls)
    if name == "nccl" and settings is not None:
        return transport(timeout_s=settings.kv_timeout_s, host=settings.kv_host, piece_bytes=settings.kv_piece_bytes,
                         trace_path=settings.kv_trace)
    return transport()
