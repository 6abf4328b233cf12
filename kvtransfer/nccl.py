"""``nccl`` transport: KV chunks pushed point to point, one process group per pair.

Roles
    decode side  ``export_pool`` hosts a TCPStore (rendezvous) and a control
                 listener. Each prefill worker that connects gets a pair: a
                 two-rank process group built straight from a PrefixStore (no
                 global ``init_process_group``, so pairs form and break as
                 workers come and go) and a receive thread that applies chunks.
    prefill side ``connect`` is lazy; the first write starts a thread that forms
                 the pair (control socket, process group, warm-up) and ends.
                 The worker loop then issues and polls everything itself,
                 without ever blocking: ``write`` and ``Transfer.done``.

Pair lifecycle (prefill side, ``PairStatus``): BOOTSTRAPPING -> READY -> FAILED;
a write on a FAILED pair forms a new one.
Chunk lifecycle (``ChunkStatus``): QUEUED (gathered, pair not ready yet) ->
SENT (header and payload issued) -> ACKED | FAILED.

Messages. Control frames (u32 length + msgpack map, at most 1 MiB) travel on a
TCP socket; the payload alone travels on the process group (nccl for a CUDA pool,
gloo for a CPU pool), so a receive is only posted for a payload already announced
(an idle NCCL receive would spin on an SM and trip the watchdog; a blocked gloo
wait cannot be interrupted, so a worker could not exit cleanly):
    prefill <- decode  socket  {"kind": "kv_hello", "v", "nonce"}
    prefill -> decode  socket  {"kind": "kv_auth", "v", "proof": HMAC(secret, "ctrl" + nonce)}
    prefill <- decode  socket  {"kind": "kv_welcome", "v", "pair_id"}  (or "kv_refused", then closed)
    prefill -> decode  group   HMAC(secret, "group" + nonce)  (the group's peer is the one on the socket)
    prefill -> decode  socket  {"kind": "kv_chunk", "v", "seq", "dst_block_ids", "handoff", "num_bytes"}
    prefill -> decode  group   gather_blocks(src_kv, src_block_ids) as bytes
    prefill <- decode  socket  {"kind": "kv_ack", "v", "seq", "error"}
    prefill -> decode  socket  {"kind": "kv_bye", "v"}

Peers: the pool's secret is random per exported pool and travels only in its
endpoint, i.e. through the cluster's Redis (the registry and PrefillJobs), so only
processes that can read that Redis can pair with the pool; the secret itself never
crosses the network. A peer without it is closed after one small frame, before
any process group or receive exists.

Ownership: the destination blocks are the decode worker's throughout. The
receive thread scatters a chunk only once its whole payload arrived, and acks
once the scatter completed on the device; ``done()`` is true only after the
ack, so PrefillDone("ok") follows every write to the request's blocks. A chunk
naming a handoff is applied only while the decode worker's grant for that
handoff covers its blocks; the worker revokes the grant before it frees them
(``PoolServer.revoke`` waits for scatters already launched), so a chunk whose
sender died, gave up or was re-dispatched never lands in blocks another
request owns. A closed control socket also stops a landed chunk.

Files: ``nccl_pair`` (wire constants, control frames, pair process groups),
``nccl_recv`` (the decode side's pool server), this module (the prefill side
and the transport).

Failures: a dead peer closes the control socket, failing its pair at the next
poll; a hung one misses ``done()``'s deadline (``timeout_s``); either way the
chunk raises TransferError and the worker loop keeps going.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time

import structlog
import torch

from tandem.kernels import ops
from tandem.cluster.settings import Settings
from tandem.kvtransfer.base import CompletedTransfer, Connection, Transfer, TransferError, Transport
from tandem.kvtransfer.nccl_pair import WIRE_VERSION, PAYLOAD_TAG, DECODE_RANK, PREFILL_RANK, POLL_S, LIVE, PairStatus, ChunkStatus, Frames, make_group, warm_up, abort_later, on_stream
from tandem.kvtransfer.nccl_pair import NONCE_BYTES, endpoint_secret, proof
from tandem.kvtransfer.nccl_recv import PoolServer

log = structlog.get_logger(__name__)


class NcclTransfer(Transfer):
    def __init__(self, pair: "_SendPair", seq: int, dst_block_ids: list[int], payload: torch.Tensor,
                 deadline: float, handoff_id: str | None):
        self.status = ChunkStatus.QUEUED
        self.error: str | None = None
        self.seq, self.dst_block_ids = seq, dst_block_ids
        self.payload = payload  # the gathered [L, 2, n, bs, H, D] as bytes; alive until acked
        self.work = None
        self.handoff_id = handoff_id  # the grant the receiving side checks
        self._pair, self._deadline = pair, deadline

    def done(self) -> bool:
        if self.status not in (ChunkStatus.ACKED, ChunkStatus.FAILED):
            pair = self._pair
            pair.pump()
            if pair.status is PairStatus.FAILED:
                self.fail(pair.error)
            elif self.status is not ChunkStatus.ACKED and time.monotonic() > self._deadline:
                waiting = "no pair with" if pair.status is PairStatus.BOOTSTRAPPING else "no ack from"
                pair.fail(f"{waiting} {pair.peer} for KV chunk {self.seq} within {pair.timeout_s:g}s")
                self.fail(pair.error)
        if self.status is ChunkStatus.FAILED:
            raise TransferError(self.error)
        return self.status is ChunkStatus.ACKED

    def on_ack(self, ack: dict) -> None:
        if ack.get("error"):
            self.fail(f"the decode side rejected KV chunk {self.seq}: {ack['error']}")
        else:
            self.status, self.payload, self.work = ChunkStatus.ACKED, None, None

    def fail(self, error: str | None) -> None:
        # payload and work stay with the object: gloo may still be reading the payload
        if self.status is not ChunkStatus.ACKED:
            self.status, self.error = ChunkStatus.FAILED, error or "KV transfer failed"


class _SendPair:
    """Prefill end of one pair: a thread forms it, the worker loop does the rest."""

    def __init__(self, endpoint: dict, device: torch.device, timeout_s: float):
        self.status = PairStatus.BOOTSTRAPPING
        self.error: str | None = None
        self.timeout_s = timeout_s
        self.peer = f"decode KV endpoint {endpoint['host']}:{endpoint['ctrl_port']}"
        self._endpoint, self._device = endpoint, device
        self._ctrl: Frames | None = None
        self._group = None
        self._queued: list[NcclTransfer] = []
        self._sent: collections.deque[NcclTransfer] = collections.deque()  # awaiting acks, in send order
        self._next_seq = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # status: the pairing thread and the worker loop
        self._thread = threading.Thread(target=self._form, name="kv-pair", daemon=True)
        self._thread.start()
        LIVE.add(self)

    def stage(self, src_kv: torch.Tensor, src_block_ids: list[int]) -> torch.Tensor:
        """Gather the chunk's blocks into one contiguous buffer now: the next forward may
        write more tokens into the last block before this chunk is sent."""
        if self._stream is None:
            src = torch.tensor(src_block_ids, dtype=torch.long)
            return ops.gather_blocks(src_kv, src).reshape(-1).view(torch.uint8)
        self._stream.wait_stream(torch.cuda.current_stream(src_kv.device))  # after the chunk's KV writes
        with torch.cuda.stream(self._stream):
            src = torch.tensor(src_block_ids, dtype=torch.long).to(src_kv.device, non_blocking=True)
            return ops.gather_blocks(src_kv, src).reshape(-1).view(torch.uint8)

    def add(self, dst_block_ids: list[int], payload: torch.Tensor, handoff_id: str | None) -> NcclTransfer:
        self._next_seq += 1
        transfer = NcclTransfer(self, self._next_seq, dst_block_ids, payload, time.monotonic() + self.timeout_s,
                                handoff_id)
        self._queued.append(transfer)
        self.pump()
        return transfer

    def pump(self) -> None:
        """Worker loop, never blocking: issue queued chunks, flush frames, take acks."""
        if self.status is not PairStatus.READY:
            return  # a FAILED pair's chunks fail in their done()
        try:
            with on_stream(self._stream):  # CUDA: NCCL's stream runs after this one, where the gathers ran
                for transfer in self._queued:
                    self._ctrl.send({"kind": "kv_chunk", "v": WIRE_VERSION, "seq": transfer.seq,
                                     "dst_block_ids": transfer.dst_block_ids, "handoff": transfer.handoff_id,
                                     "num_bytes": transfer.payload.numel()})
                    transfer.work = self._group.send([transfer.payload], DECODE_RANK, PAYLOAD_TAG)
                    transfer.status = ChunkStatus.SENT
                    self._sent.append(transfer)
            self._queued.clear()
            self._ctrl.flush()
            for ack in self._ctrl.received():
                transfer = self._sent.popleft() if self._sent else None
                if transfer is None or ack.get("kind") != "kv_ack" or ack.get("seq") != transfer.seq:
                    raise TransferError(f"unexpected {ack!r}")
                transfer.on_ack(ack)
        except Exception as exc:  # the peer is gone or broke the protocol
            self.fail(f"KV pair with {self.peer} broke: {exc}")

    def fail(self, error: str | None) -> None:
        with self._lock:
            if self.status is PairStatus.FAILED:
                return
            self.error, self.status = error or "KV pair failed", PairStatus.FAILED
        self._stop.set()
        if self._ctrl is not None:
            self._ctrl.sock.close()  # the receive thread sees EOF and ends the pair there
        abort_later(self._group)

    def close(self, join_s: float = 0.0) -> None:
        if self.status is PairStatus.READY:
            with contextlib.suppress(OSError):
                self._ctrl.send({"kind": "kv_bye", "v": WIRE_VERSION})
        self.fail("connection closed")
        self._thread.join(join_s)

    def _form(self) -> None:
        """Pairing thread: control connection, hello and proof, welcome, process group, warm-up."""
        endpoint, sock = self._endpoint, None
        deadline = time.monotonic() + self.timeout_s
        try:
            secret = endpoint_secret(endpoint)
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            sock = socket.create_connection((endpoint["host"], endpoint["ctrl_port"]), timeout=self.timeout_s)
            sock.settimeout(POLL_S)
            ctrl = Frames(sock)
            hello = ctrl.wait(self._stop, deadline)
            first = hello[0] if hello and isinstance(hello[0], dict) else {}
            nonce = first.get("nonce")
            if first.get("kind") != "kv_hello" or first.get("v") != WIRE_VERSION or not (
                    isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES):
                raise TransferError(f"unexpected hello {hello!r}")
            ctrl.send({"kind": "kv_auth", "v": WIRE_VERSION, "proof": proof(secret, nonce, b"ctrl")})
            welcome = ctrl.wait(self._stop, deadline)
            if welcome and welcome[0].get("kind") == "kv_refused":
                raise TransferError(f"the decode side refused the pair: {welcome[0].get('error')}")
            if not welcome or welcome[0].get("kind") != "kv_welcome" or welcome[0].get("v") != WIRE_VERSION:
                raise TransferError(f"unexpected welcome {welcome!r}")
            self._group = make_group(endpoint["store_port"], welcome[0]["pair_id"], PREFILL_RANK,
                                      endpoint["backend"], endpoint["host"], self.timeout_s)
            warm_up(self._group, PREFILL_RANK, self._device, self.timeout_s, proof(secret, nonce, b"group"))
            sock.setblocking(False)
        except Exception as exc:
            if sock is not None:
                sock.close()
            self.fail(f"cannot pair with {self.peer}: {exc}")
            return
        with self._lock:
            self._ctrl = ctrl
            if self.status is PairStatus.BOOTSTRAPPING:
                self.status = PairStatus.READY
                return
        sock.close()  # failed meanwhile (its chunks' deadline): let the receive thread go


class _AllTransfers(Transfer):
    """One write sent as several pieces: done once every piece is; the first failure raises."""

    def __init__(self, pieces: list[NcclTransfer]):
        self._pieces = pieces

    def done(self) -> bool:
        self._pieces = [piece for piece in self._pieces if not piece.done()]
        return not self._pieces


class NcclConnection(Connection):
    """``piece_bytes`` (--kv-piece-bytes, 128 MiB): a write larger than this goes as
    several chunks, so the gather of one piece, the transfer of the previous one and the
    scatter of the one before overlap (one 1.07 GB chunk: 230 GB/s; the same bytes as 8
    chunks: 264-271 GB/s on two H200s)."""

    def __init__(self, endpoint: dict, timeout_s: float, piece_bytes: int | None = None):
        self._endpoint, self._timeout_s = endpoint, timeout_s
        self._pair: _SendPair | None = None
        self._closed = False
        if piece_bytes is None:
            piece_bytes = Settings.field_default("kv_piece_bytes")
        try:
            layout = endpoint["layout"]
            block_bytes = (layout["num_layers"] * 2 * layout["block_size"] * layout["num_kv_heads"]
                           * layout["head_dim"] * torch.empty((), dtype=getattr(torch, layout["dtype"])).element_size())
        except (KeyError, TypeError, AttributeError) as exc:
            raise TransferError(f"an nccl KV endpoint without a readable pool layout: {exc!r}") from exc
        self.blocks_per_piece = max(1, piece_bytes // max(block_bytes, 1))

    def write(self, src_kv: torch.Tensor, src_block_ids: list[int], dst_block_ids: list[int],
              handoff_id: str | None = None) -> Transfer:
        if self._closed:
            raise TransferError("the connection to this decode worker is closed (the worker restarted)")
        self._check(src_kv, src_block_ids, dst_block_ids)
        if not src_block_ids:
            return CompletedTransfer()
        if self._pair is None or self._pair.status is PairStatus.FAILED:
            self._pair = _SendPair(self._endpoint, src_kv.device, self._timeout_s)
        pair, per = self._pair, self.blocks_per_piece
        pieces = [pair.add(list(dst_block_ids[i:i + per]), pair.stage(src_kv, src_block_ids[i:i + per]), handoff_id)
                  for i in range(0, len(src_block_ids), per)]
        return pieces[0] if len(pieces) == 1 else _AllTransfers(pieces)

    def close(self) -> None:
        self._closed = True
        if self._pair is not None:
            self._pair.close()

    def _check(self, src_kv: torch.Tensor, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        layout, backend = self._endpoint["layout"], self._endpoint["backend"]
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
        expected = (layout["num_layers"], 2, layout["block_size"], layout["num_kv_heads"], layout["head_dim"])
        if (*src_kv.shape[:2], *src_kv.shape[3:]) != expected or str(src_kv.dtype) != f"torch.{layout['dtype']}":
            raise TransferError(f"pool layouts differ: {tuple(src_kv.shape)} {src_kv.dtype} vs {layout}")
        if any(not 0 <= b < layout["num_blocks"] for b in dst_block_ids):
            raise TransferError(f"destination blocks {dst_block_ids} outside the peer pool of {layout['num_blocks']}")
        if src_kv.is_cuda != (backend == "nccl"):
            raise TransferError(f"a {src_kv.device} source cannot reach a {backend} peer pool")


class NcclTransport(Transport):
    """Settings (``tandem.cluster.settings``; each None here: the setting's variable, else its
    default): ``timeout_s`` how long a chunk may go unacknowledged (--kv-timeout-s); ``host`` the
    address peers reach the decode side at (--kv-host); ``piece_bytes`` the largest single write
    (--kv-piece-bytes); ``trace_path`` a receive timeline written at close (--kv-trace)."""

    name = "nccl"

    def __init__(self, timeout_s: float | None = None, host: str | None = None, piece_bytes: int | None = None,
                 trace_path: str | None = None):
        self.timeout_s = timeout_s if timeout_s is not None else Settings.field_default("kv_timeout_s")
        self.host = host or Settings.field_default("kv_host")
        self.piece_bytes = piece_bytes or Settings.field_default("kv_piece_bytes")
        self.trace_path = trace_path if trace_path is not None else Settings.field_default("kv_trace")
        self._servers: list[PoolServer] = []

    def export_pool(self, pool, rank_pools=()) -> dict:
        if rank_pools:
            raise TransferError(f"the {self.name} transport moves one pool; a split model's (--tensor-parallel-size "
                                "above 1) hands KV over with the shm transport only, for now")
        try:
            server = PoolServer(pool, self.host, self.timeout_s, self.trace_path)
        except (OSError, RuntimeError) as exc:
            raise TransferError(f"cannot listen for KV pairs on {self.host}: {exc}") from exc
        self._servers.append(server)
        return server.endpoint

    revoke_stops_writes = True  # the receiving side applies chunks under its grants

    def grant(self, handoff_id: str, block_ids: list[int]) -> None:
        for server in self._servers:
            server.grant(handoff_id, block_ids)

    def revoke(self, handoff_id: str) -> None:
        for server in self._servers:
            server.revoke(handoff_id)

    def connect(self, endpoint: dict) -> Connection:
        if endpoint.get("transport") != self.name or endpoint.get("backend") not in ("gloo", "nccl"):
            # not the endpoint itself: it may hold a secret, and this message reaches PrefillDone
            raise TransferError(f"not an nccl KV endpoint (transport {endpoint.get('transport')!r}, "
                                f"backend {endpoint.get('backend')!r})")
        return NcclConnection(endpoint, self.timeout_s, self.piece_bytes)

    def close(self) -> None:
        """Stop accepting pairs and end the receive threads."""
        for server in self._servers:
            server.close(join_s=1.0)
