"""Shared pieces of the ``nccl`` transport: wire constants, control frames, pair process groups.

See ``tandem.kvtransfer.nccl`` for the protocol, the roles and the ownership rules.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import enum
import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
import weakref

import msgpack
import structlog
import torch
import torch.distributed as dist

from tandem.kvtransfer.base import TransferError
log = structlog.get_logger(__name__)

WIRE_VERSION = 2  # 2: the hello/auth handshake and the group proof
PAYLOAD_TAG = 1
DECODE_RANK, PREFILL_RANK = 0, 1
POLL_S = 0.1  # how often blocked threads look at their stop flag
# a chunk header lists its block ids (a few bytes each): far below this; a longer frame is not ours
MAX_FRAME_BYTES = 1 << 20
HANDSHAKE_FRAME_BYTES = 1024  # before a peer has proved itself, only the small auth frame is read
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
LIVE = weakref.WeakSet()  # servers and pairs whose threads must stop before the process exits


@atexit.register
def _stop_threads_at_exit() -> None:
    """A daemon thread returning from a c10d call during interpreter shutdown is
    unwound through C++ and aborts the process, so stop and join them first."""
    for owner in list(LIVE):
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
class Frames:
    """Length-prefixed msgpack maps over a socket, buffered both ways, so the same code
    serves a non-blocking socket (worker loop) and one with a timeout (threads)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes  # a longer frame ends the connection
        # small frames must not wait: with Nagle on, an ack behind unacknowledged data waited
        # for the peer's delayed ACK (40 ms on Linux), which made 8 chunks take 48 ms, not 5
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
            if size > self.max_frame_bytes:
                raise ConnectionError(f"control frame of {size} bytes (at most {self.max_frame_bytes})")
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
        """Threads only: block (at most ``POLL_S`` per call into the socket) for frames."""
        while not stop.is_set():
            self.flush()
            if frames := self.received():
                return frames
            if time.monotonic() > deadline:
                raise TimeoutError("no control frame in time")
        return []


def proof(secret: bytes, nonce: bytes, purpose: bytes) -> bytes:
    """What a prefill worker shows for the decode side's ``nonce``: HMAC-SHA256 under the pool's
    secret, so the secret itself never travels; ``purpose`` keeps the two proofs apart."""
    return hmac.new(secret, purpose + nonce, hashlib.sha256).digest()


def endpoint_secret(endpoint: dict) -> bytes:
    """The pool's secret, from its endpoint (which only the cluster's Redis carries)."""
    try:
        secret = bytes.fromhex(endpoint["secret"])
    except (KeyError, TypeError, ValueError):
        raise TransferError("an nccl KV endpoint without its secret (a decode worker of an older version?)") from None
    if len(secret) < 16:
        raise TransferError("an nccl KV endpoint with a short secret")
    return secret


def make_group(store_port: int, pair_id: str, rank: int, backend: str, host: str, timeout_s: float):
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
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_address(rank, host))]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def gloo_address(rank: int, host: str) -> str:
    """Where a side's gloo device listens, which it advertises to its peer through the store.
    ``host`` is the decode side's endpoint address (--kv-host), which the decode side
    listens on already; the prefill side takes its own address on the route to it. Not gloo's
    default device: that is the machine's hostname resolved, often a loopback address (an
    /etc/hosts line) the peer on another host then dials at home, or another interface's."""
    return host if rank == DECODE_RANK else local_address(host)


def local_address(peer: str) -> str:
    """This host's address on the route to ``peer`` (a UDP connect picks the source address and
    sends nothing); loopback for a loopback peer."""
    family, _, _, _, sockaddr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        return sock.getsockname()[0]


def warm_up(group, rank: int, device: torch.device, timeout_s: float, group_proof: bytes) -> None:
    """The prefill side's proof for the group, sent over the group itself in the pairing
    threads: so the NCCL communicator is created there, not inside the first real send on the
    worker loop, and the decode side knows its peer in the group is the one that authenticated
    on the control socket (the TCPStore takes anyone, who could join a pair being formed)."""
    if rank == PREFILL_RANK:
        probe = torch.frombuffer(bytearray(group_proof), dtype=torch.uint8).to(device)
        group.send([probe], DECODE_RANK, PAYLOAD_TAG).wait()
    else:
        probe = torch.zeros(PROOF_BYTES, dtype=torch.uint8, device=device)
        group.recv([probe], PREFILL_RANK, PAYLOAD_TAG).wait()
    if device.type == "cuda":
        wait_device(time.monotonic() + timeout_s)
    if rank == DECODE_RANK and not hmac.compare_digest(probe.cpu().numpy().tobytes(), group_proof):
        raise TransferError("the peer that joined the pair's process group did not prove the pool's secret")


def wait_device(deadline: float) -> None:
    """Threads only: poll (a sync could hang on a dead peer) until the current stream's work ran."""
    event = torch.cuda.Event()
    event.record()
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferError("the KV payload did not land on the device in time")
        time.sleep(0.0002)


def abort_later(group) -> None:
    """End an NCCL communicator whose kernels may wait on a dead peer, off the worker
    loop (gloo needs nothing: its waits fail once the peer's sockets close)."""
    if group is not None and not isinstance(group, dist.ProcessGroupGloo):
        threading.Thread(target=abort_group, args=(group,), name="kv-abort", daemon=True).start()


def abort_group(group) -> None:
    with contextlib.suppress(Exception):
        group.abort()


def on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ---- decode side ------------------------------------------------------------------------
