"""Decode side of the ``nccl`` transport: the pool server that accepts pairs and applies chunks.

See ``kvtransfer.nccl`` for the protocol, the roles and the ownership rules.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import uuid

import structlog
import torch
import torch.distributed as dist

from kernels import ops
from kvtransfer.base import TransferError
from kvtransfer.nccl_pair import WIRE_VERSION, PAYLOAD_TAG, DECODE_RANK, PREFILL_RANK, POLL_S, LIVE, Frames, make_group, warm_up, wait_device, abort_later, on_stream

log = structlog.get_logger(__name__)


class PoolServer:
    """Accepts pairs for one exported pool; one receive thread per pair."""

    def __init__(self, pool, host: str, timeout_s: float):
        self._kv = pool.kv  # [L, 2, N, bs, H, D]
        self._backend = "nccl" if self._kv.is_cuda else "gloo"
        self._host, self._timeout_s = host, timeout_s
        self._bytes_per_block = self._kv[:, :, 0].numel() * self._kv.element_size()
        self._stop = threading.Event()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(POLL_S)
        self.endpoint = {
            "transport": "nccl", "backend": self._backend, "host": host, "store_port": self._store.port,
            "ctrl_port": self._listener.getsockname()[1], "instance": uuid.uuid4().hex, "layout": pool.layout(),
        }
        self._threads = [threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)]
        self._threads[0].start()
        LIVE.add(self)

    def close(self, join_s: float = 0.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + join_s
        for thread in list(self._threads):
            thread.join(max(deadline - time.monotonic(), 0))

    def _accept_loop(self) -> None:
        pair_id = 0
        with self._listener:
            while not self._stop.is_set():
                try:
                    conn, _addr = self._listener.accept()
                except TimeoutError:
                    continue
                pair_id += 1
                thread = threading.Thread(target=self._serve_pair, args=(conn, pair_id),
                                          name=f"kv-recv-{pair_id}", daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()

    def _serve_pair(self, conn: socket.socket, pair_id: int) -> None:
        device, group = self._kv.device, None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            with conn:
                conn.settimeout(POLL_S)
                ctrl = Frames(conn)
                ctrl.send({"kind": "kv_welcome", "v": WIRE_VERSION, "pair_id": pair_id})
                group = make_group(self._store.port, pair_id, DECODE_RANK, self._backend, self._host,
                                    self._timeout_s)
                warm_up(group, DECODE_RANK, device, self._timeout_s)
                with on_stream(torch.cuda.Stream(device) if device.type == "cuda" else None):
                    while frames := ctrl.wait(self._stop):
                        for header in frames:
                            if header.get("kind") == "kv_bye":
                                return
                            error = self._apply(group, header, ctrl)
                            ctrl.send({"kind": "kv_ack", "v": WIRE_VERSION, "seq": header.get("seq"),
                                       "error": error})
        except Exception as exc:  # this pair is over (peer gone, broken frame); the pool is not
            log.info("kv pair closed", pair_id=pair_id, error=str(exc)[:300])
            abort_later(group)

    def _apply(self, group, header: dict, ctrl: Frames) -> str | None:
        """Receive one payload and scatter it; -> an error for the ack, or None."""
        error = self._check(header)
        num_bytes = header.get("num_bytes")
        if error is not None and not (isinstance(num_bytes, int) and 0 < num_bytes <= self._kv.nbytes):
            raise TransferError(f"unreadable chunk header {header!r}: {error}")  # cannot resync: drop the pair
        kv = self._kv
        payload = torch.empty(num_bytes, dtype=torch.uint8, device=kv.device)
        group.recv([payload], PREFILL_RANK, PAYLOAD_TAG).wait()  # CUDA: the stream waits, not the CPU
        if kv.is_cuda:
            wait_device(time.monotonic() + self._timeout_s)
        if error is not None:
            return error  # drained, so the next chunk still lines up
        if ctrl.peer_gave_up():  # its PrefillDone("failed") may be on the way: the blocks are not ours
            raise TransferError("the sender closed the pair before its chunk was applied")
        dst_block_ids = header["dst_block_ids"]
        staging = payload.view(kv.dtype).view(kv.shape[0], 2, len(dst_block_ids), *kv.shape[3:])
        ops.scatter_blocks(kv, torch.tensor(dst_block_ids, dtype=torch.long).to(kv.device), staging)
        if kv.is_cuda:
            wait_device(time.monotonic() + self._timeout_s)
        return None

    def _check(self, header: dict) -> str | None:
        if header.get("kind") != "kv_chunk" or header.get("v") != WIRE_VERSION:
            return f"unexpected message kind={header.get('kind')!r} v={header.get('v')!r}"
        ids, num_blocks = header.get("dst_block_ids"), self._kv.shape[2]
        if not ids or any(not 0 <= b < num_blocks for b in ids):
            return f"destination block ids {ids} outside the pool of {num_blocks} blocks"
        if header.get("num_bytes") != len(ids) * self._bytes_per_block:
            return f"{header.get('num_bytes')} payload bytes for {len(ids)} blocks"
        return None


# ---- prefill side -----------------------------------------------------------------------
