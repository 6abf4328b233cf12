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

Messages. Control frames (u32 length + msgpack map) travel on a TCP socket;
the payload alone travels on the process group (nccl for a CUDA pool, gloo for
a CPU pool), so a receive is only posted for a payload already announced (an
idle NCCL receive would spin on an SM and trip the watchdog; a blocked gloo
wait cannot be interrupted, so a worker could not exit cleanly):
    prefill <- decode  socket  {"kind": "kv_welcome", "v", "pair_id"}
    prefill -> decode  socket  {"kind": "kv_chunk", "v", "seq", "dst_block_ids", "num_bytes"}
    prefill -> decode  group   gather_blocks(src_kv, src_block_ids) as bytes
    prefill <- decode  socket  {"kind": "kv_ack", "v", "seq", "error"}
    prefill -> decode  socket  {"kind": "kv_bye", "v"}

Ownership: the destination blocks are the decode worker's throughout. The
receive thread writes a chunk's blocks only once its whole payload arrived
(on CUDA: once the scatter completed on the device), then acks; ``done()`` is
true only after the ack, so PrefillDone("ok") follows every write to the
request's blocks. A chunk whose sender died or gave up (a failed pair closes
its control socket before the prefill worker reports the failure) is not
applied. Left open: the narrow race where the close is still in flight while
the scatter starts, and the decode worker's own handoff deadline; closing it
needs the decode worker to wait for its receive threads before freeing.

Failures: a dead peer closes the control socket, failing its pair at the next
poll; a hung one misses ``done()``'s deadline (``timeout_s``); either way the
chunk raises TransferError and the worker loop keeps going.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import enum
import os
import select
import socket
import struct
import threading
import time
import uuid
import weakref

import msgpack
import structlog
import torch
import torch.distributed as dist

from kernels import ops
from kvtransfer.base import CompletedTransfer, Connection, Transfer, TransferError, Transport

log = structlog.get_logger(__name__)

WIRE_VERSION = 1
PAYLOAD_TAG = 1
DECODE_RANK, PREFILL_RANK = 0, 1
_POLL_S = 0.1  # how often blocked threads look at their stop flag
_MAX_FRAME_BYTES = 1 << 24
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_live = weakref.WeakSet()  # servers and pairs whose threads must stop before the process exits


@atexit.register
def _stop_threads_at_exit() -> None:
    """A daemon thread returning from a c10d call during interpreter shutdown is
    unwound through C++ and aborts the process, so stop and join them first."""
    for owner in list(_live):
        owner.close(join_s=1.0)


class PairStatus(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    READY = "ready"
    FAILED = "failed"


class ChunkStatus(enum.Enum):
    QUEUED = "queued"
    SENT = "sent"
    ACKED = "acked"
    FAILED = "failed"


# ---- control frames and the process group (both sides) ---------------------------------
class _Frames:
    """Length-prefixed msgpack maps over a socket, buffered both ways, so the same code
    serves a non-blocking socket (worker loop) and one with a timeout (threads)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._in, self._out = bytearray(), bytearray()

    def send(self, message: dict) -> None:
        body = msgpack.packb(message)
        self._out += struct.pack(">I", len(body)) + body
        self.flush()

    def flush(self) -> None:
        """Write what the socket takes now; the rest waits for the next call."""
        while self._out:
            try:
                del self._out[: self.sock.send(self._out)]
            except (BlockingIOError, TimeoutError):
                return

    def received(self) -> list[dict]:
        """Complete frames after one read (which, with a timeout, waits up to it);
        ConnectionError once the peer is gone."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, TimeoutError):
            data = None
        if data == b"":
            raise ConnectionError("the peer closed the control connection")
        self._in += data or b""
        frames = []
        while len(self._in) >= 4:
            (size,) = struct.unpack_from(">I", self._in)
            if size > _MAX_FRAME_BYTES:
                raise ConnectionError(f"control frame of {size} bytes")
            if len(self._in) < 4 + size:
                break
            frames.append(msgpack.unpackb(bytes(self._in[4 : 4 + size])))
            del self._in[: 4 + size]
        return frames

    def peer_gave_up(self) -> bool:
        """True once the peer closed its end (a failed pair), without consuming frames."""
        if not select.select([self.sock], [], [], 0)[0]:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def wait(self, stop: threading.Event, deadline: float = float("inf")) -> list[dict]:
        """Threads only: block (at most ``_POLL_S`` per call into the socket) for frames."""
        while not stop.is_set():
            self.flush()
            if frames := self.received():
                return frames
            if time.monotonic() > deadline:
                raise TimeoutError("no control frame in time")
        return []


def _make_group(store_port: int, pair_id: int, rank: int, backend: str, host: str, timeout_s: float):
    """The pair's process group; blocks until the peer joins (threads only)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # a store client per pair: a rendezvous blocks its client while it waits
    store = dist.TCPStore(host, store_port, is_master=False, wait_for_workers=False, timeout=timeout)
    store = dist.PrefixStore(f"tandem-kv/pair/{pair_id}/", store)
    if backend == "nccl":
        # 2 = abort the communicator on a watchdog timeout but keep the process: a dead
        # peer must fail its transfers, not kill the worker (torch's default tears it down)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        return dist.ProcessGroupNCCL(store, rank, 2, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host in _LOOPBACK
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _warm_up(group, rank: int, device: torch.device, timeout_s: float) -> None:
    """One byte from prefill to decode in the pairing threads, so the NCCL communicator
    is created there, not inside the first real send on the worker loop."""
    probe = torch.zeros(1, dtype=torch.uint8, device=device)
    if rank == PREFILL_RANK:
        group.send([probe], DECODE_RANK, PAYLOAD_TAG).wait()
    else:
        group.recv([probe], PREFILL_RANK, PAYLOAD_TAG).wait()
    if device.type == "cuda":
        _wait_device(time.monotonic() + timeout_s)


def _wait_device(deadline: float) -> None:
    """Threads only: poll (a sync could hang on a dead peer) until the current stream's work ran."""
    event = torch.cuda.Event()
    event.record()
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferError("the KV payload did not land on the device in time")
        time.sleep(0.0002)


def _abort_later(group) -> None:
    """End an NCCL communicator whose kernels may wait on a dead peer, off the worker
    loop (gloo needs nothing: its waits fail once the peer's sockets close)."""
    if group is not None and not isinstance(group, dist.ProcessGroupGloo):
        threading.Thread(target=_abort, args=(group,), name="kv-abort", daemon=True).start()


def _abort(group) -> None:
    with contextlib.suppress(Exception):
        group.abort()


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ---- decode side ------------------------------------------------------------------------
class _PoolServer:
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
        self._listener.settimeout(_POLL_S)
        self.endpoint = {
            "transport": "nccl", "backend": self._backend, "host": host, "store_port": self._store.port,
            "ctrl_port": self._listener.getsockname()[1], "instance": uuid.uuid4().hex, "layout": pool.layout(),
        }
        self._threads = [threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)]
        self._threads[0].start()
        _live.add(self)

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
                conn.settimeout(_POLL_S)
                ctrl = _Frames(conn)
                ctrl.send({"kind": "kv_welcome", "v": WIRE_VERSION, "pair_id": pair_id})
                group = _make_group(self._store.port, pair_id, DECODE_RANK, self._backend, self._host,
                                    self._timeout_s)
                _warm_up(group, DECODE_RANK, device, self._timeout_s)
                with _on_stream(torch.cuda.Stream(device) if device.type == "cuda" else None):
                    while frames := ctrl.wait(self._stop):
                        for header in frames:
                            if header.get("kind") == "kv_bye":
                                return
                            error = self._apply(group, header, ctrl)
                            ctrl.send({"kind": "kv_ack", "v": WIRE_VERSION, "seq": header.get("seq"),
                                       "error": error})
        except Exception as exc:  # this pair is over (peer gone, broken frame); the pool is not
            log.info("kv pair closed", pair_id=pair_id, error=str(exc)[:300])
            _abort_later(group)

    def _apply(self, group, header: dict, ctrl: _Frames) -> str | None:
        """Receive one payload and scatter it; -> an error for the ack, or None."""
        error = self._check(header)
        num_bytes = header.get("num_bytes")
        if error is not None and not (isinstance(num_bytes, int) and 0 < num_bytes <= self._kv.nbytes):
            raise TransferError(f"unreadable chunk header {header!r}: {error}")  # cannot resync: drop the pair
        kv = self._kv
        payload = torch.empty(num_bytes, dtype=torch.uint8, device=kv.device)
        group.recv([payload], PREFILL_RANK, PAYLOAD_TAG).wait()  # CUDA: the stream waits, not the CPU
        if kv.is_cuda:
            _wait_device(time.monotonic() + self._timeout_s)
        if error is not None:
            return error  # drained, so the next chunk still lines up
        if ctrl.peer_gave_up():  # its PrefillDone("failed") may be on the way: the blocks are not ours
            raise TransferError("the sender closed the pair before its chunk was applied")
        dst_block_ids = header["dst_block_ids"]
        staging = payload.view(kv.dtype).view(kv.shape[0], 2, len(dst_block_ids), *kv.shape[3:])
        ops.scatter_blocks(kv, torch.tensor(dst_block_ids, dtype=torch.long).to(kv.device), staging)
        if kv.is_cuda:
            _wait_device(time.monotonic() + self._timeout_s)
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
class NcclTransfer(Transfer):
    def __init__(self, pair: "_SendPair", seq: int, dst_block_ids: list[int], payload: torch.Tensor,
                 deadline: float):
        self.status = ChunkStatus.QUEUED
        self.error: str | None = None
        self.seq, self.dst_block_ids = seq, dst_block_ids
        self.payload = payload  # the gathered [L, 2, n, bs, H, D] as bytes; alive until acked
        self.work = None
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
        self._ctrl: _Frames | None = None
        self._group = None
        self._queued: list[NcclTransfer] = []
        self._sent: collections.deque[NcclTransfer] = collections.deque()  # awaiting acks, in send order
        self._next_seq = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # status: the pairing thread and the worker loop
        self._thread = threading.Thread(target=self._form, name="kv-pair", daemon=True)
        self._thread.start()
        _live.add(self)

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

    def add(self, dst_block_ids: list[int], payload: torch.Tensor) -> NcclTransfer:
        self._next_seq += 1
        transfer = NcclTransfer(self, self._next_seq, dst_block_ids, payload, time.monotonic() + self.timeout_s)
        self._queued.append(transfer)
        self.pump()
        return transfer

    def pump(self) -> None:
        """Worker loop, never blocking: issue queued chunks, flush frames, take acks."""
        if self.status is not PairStatus.READY:
            return  # a FAILED pair's chunks fail in their done()
        try:
            with _on_stream(self._stream):  # CUDA: NCCL's stream runs after this one, where the gathers ran
                for transfer in self._queued:
                    self._ctrl.send({"kind": "kv_chunk", "v": WIRE_VERSION, "seq": transfer.seq,
                                     "dst_block_ids": transfer.dst_block_ids,
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
        _abort_later(self._group)

    def close(self, join_s: float = 0.0) -> None:
        if self.status is PairStatus.READY:
            with contextlib.suppress(OSError):
                self._ctrl.send({"kind": "kv_bye", "v": WIRE_VERSION})
        self.fail("connection closed")
        self._thread.join(join_s)

    def _form(self) -> None:
        """Pairing thread: control connection, welcome, process group, warm-up."""
        endpoint, sock = self._endpoint, None
        deadline = time.monotonic() + self.timeout_s
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            sock = socket.create_connection((endpoint["host"], endpoint["ctrl_port"]), timeout=self.timeout_s)
            sock.settimeout(_POLL_S)
            ctrl = _Frames(sock)
            welcome = ctrl.wait(self._stop, deadline)
            if not welcome or welcome[0].get("kind") != "kv_welcome" or welcome[0].get("v") != WIRE_VERSION:
                raise TransferError(f"unexpected welcome {welcome!r}")
            self._group = _make_group(endpoint["store_port"], welcome[0]["pair_id"], PREFILL_RANK,
                                      endpoint["backend"], endpoint["host"], self.timeout_s)
            _warm_up(self._group, PREFILL_RANK, self._device, self.timeout_s)
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


class NcclConnection(Connection):
    def __init__(self, endpoint: dict, timeout_s: float):
        self._endpoint, self._timeout_s = endpoint, timeout_s
        self._pair: _SendPair | None = None

    def write(self, src_kv: torch.Tensor, src_block_ids: list[int], dst_block_ids: list[int]) -> Transfer:
        self._check(src_kv, src_block_ids, dst_block_ids)
        if not src_block_ids:
            return CompletedTransfer()
        if self._pair is None or self._pair.status is PairStatus.FAILED:
            self._pair = _SendPair(self._endpoint, src_kv.device, self._timeout_s)
        return self._pair.add(list(dst_block_ids), self._pair.stage(src_kv, src_block_ids))

    def close(self) -> None:
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
    """``timeout_s``: how long a chunk may go unacknowledged (env TANDEM_KV_TIMEOUT_S, 60);
    ``host``: the address peers reach the decode side at (env TANDEM_KV_HOST, loopback)."""

    name = "nccl"

    def __init__(self, timeout_s: float | None = None, host: str | None = None):
        self.timeout_s = timeout_s if timeout_s is not None else float(os.environ.get("TANDEM_KV_TIMEOUT_S", 60))
        self.host = host or os.environ.get("TANDEM_KV_HOST", "127.0.0.1")
        self._servers: list[_PoolServer] = []

    def export_pool(self, pool) -> dict:
        try:
            server = _PoolServer(pool, self.host, self.timeout_s)
        except (OSError, RuntimeError) as exc:
            raise TransferError(f"cannot listen for KV pairs on {self.host}: {exc}") from exc
        self._servers.append(server)
        return server.endpoint

    def connect(self, endpoint: dict) -> Connection:
        if endpoint.get("transport") != self.name or endpoint.get("backend") not in ("gloo", "nccl"):
            raise TransferError(f"not an nccl KV endpoint: {endpoint!r}")
        return NcclConnection(endpoint, self.timeout_s)

    def close(self) -> None:
        """Stop accepting pairs and end the receive threads."""
        for server in self._servers:
            server.close(join_s=1.0)
