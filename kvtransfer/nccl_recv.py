"""Decode side of the ``nccl`` transport: the pool server that accepts pairs and applies chunks.

See ``tandem.kvtransfer.nccl`` for the protocol, the roles and the ownership rules.
"""

from __future__ import annotations

import collections
import json
import hmac
import dataclasses
import datetime
import secrets
import socket
import threading
import time
import uuid

import structlog
import torch
import torch.distributed as dist

from tandem.kernels import ops
from tandem.kvtransfer.base import TransferError
from tandem.kvtransfer.nccl_pair import WIRE_VERSION, PAYLOAD_TAG, DECODE_RANK, PREFILL_RANK, POLL_S, LIVE, Frames, make_group, warm_up, abort_later, on_stream
from tandem.kvtransfer.nccl_pair import HANDSHAKE_FRAME_BYTES, MAX_FRAME_BYTES, NONCE_BYTES, proof

log = structlog.get_logger(__name__)


MAX_AHEAD = 4  # chunks whose payload receives are posted at once (their buffers are alive together)
MAX_AHEAD_BYTES = 1 << 30  # ... and at most this many payload bytes (one chunk is always allowed)
SPIN_S = 0.05  # while chunks are in flight, poll the device without sleeping this long after progress
# (a sleep of 20 us took milliseconds on the Firecracker GPU machines: 6 ms per chunk, 22 GB/s)


@dataclasses.dataclass
class _Chunk:
    header: dict
    error: str | None
    payload: torch.Tensor
    work: object  # the payload's receive
    deadline: float
    applied: object = None  # CUDA event after the scatter (None: nothing on the device to wait for)
    handoff: str | None = None


def _num_bytes(header: dict) -> int:
    num_bytes = header.get("num_bytes")
    return num_bytes if isinstance(num_bytes, int) else 0


class PoolServer:
    """Accepts pairs for one exported pool; one receive thread per pair.

    Grants: the decode worker ``grant``s a handoff its destination blocks when it
    hands a prefill job out and ``revoke``s it when the handoff ends. A chunk that
    names a handoff is applied only while that handoff holds a grant covering its
    blocks, and ``revoke`` returns only after the scatters of that handoff already
    on the device finished, so the decode worker may free the blocks right after
    it: a late chunk (its sender gave up, or was taken for dead) never writes
    blocks that another request owns. Chunks that name no handoff (the transport's
    own tests) are applied as they come.

    Peers: anyone who reaches the host may connect, so a pair is formed only with a
    peer that proves it knows the pool's secret (a random one per pool, handed out in
    the endpoint, which travels only through the cluster's Redis): the control
    connection opens with a nonce the peer answers with its HMAC, and the peer in the
    process group then sends a second HMAC of it over the group. Until then nothing it
    sends is read beyond one small frame, and no receive into the pool is posted.
    """

    def __init__(self, pool, host: str, timeout_s: float, trace_path: str | None = None):
        self._kv = pool.kv  # [L, 2, N, bs, H, D]
        self._backend = "nccl" if self._kv.is_cuda else "gloo"
        self._host, self._timeout_s = host, timeout_s
        self._trace_path = trace_path  # diagnostics (--kv-trace): per-chunk receive timeline, written at close
        self._bytes_per_block = self._kv[:, :, 0].numel() * self._kv.element_size()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # grants and scatters in flight: receive threads and the worker loop
        self._grants: dict[str, frozenset[int]] = {}
        self._scattering: dict[str, list] = collections.defaultdict(list)  # handoff -> CUDA events
        self._secret = secrets.token_bytes(32)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(POLL_S)
        self.endpoint = {
            "transport": "nccl", "backend": self._backend, "host": host, "store_port": self._store.port,
            "ctrl_port": self._listener.getsockname()[1], "instance": uuid.uuid4().hex, "layout": pool.layout(),
            "kv_format": pool.kv_format(), "secret": self._secret.hex(),
        }
        self._trace: list[tuple] = []
        self._threads = [threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)]
        self._threads[0].start()
        LIVE.add(self)

    def _mark(self, chunk_or_header, what: str) -> None:
        if self._trace_path:
            header = chunk_or_header if isinstance(chunk_or_header, dict) else chunk_or_header.header
            self._trace.append((header.get("seq"), what, time.perf_counter()))

    def grant(self, handoff_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._grants[handoff_id] = frozenset(block_ids)

    def revoke(self, handoff_id: str) -> None:
        """No chunk of this handoff is applied after this returns."""
        with self._lock:
            self._grants.pop(handoff_id, None)
            events = self._scattering.pop(handoff_id, [])
        for event in events:  # a block scatter already launched on a healthy device: microseconds
            event.synchronize()

    def close(self, join_s: float = 0.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + join_s
        for thread in list(self._threads):
            thread.join(max(deadline - time.monotonic(), 0))
        if self._trace_path and self._trace:
            with open(self._trace_path, "w") as f:
                json.dump(self._trace, f)

    def _accept_loop(self) -> None:
        pair_id = 0
        with self._listener:
            while not self._stop.is_set():
                try:
                    conn, addr = self._listener.accept()
                except TimeoutError:
                    continue
                pair_id += 1
                thread = threading.Thread(target=self._serve_pair, args=(conn, pair_id, addr),
                                          name=f"kv-recv-{pair_id}", daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()

    def _serve_pair(self, conn: socket.socket, pair_id: int, addr=None) -> None:
        device, group = self._kv.device, None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            with conn:
                conn.settimeout(POLL_S)
                ctrl = Frames(conn, max_frame_bytes=HANDSHAKE_FRAME_BYTES)
                nonce = secrets.token_bytes(NONCE_BYTES)
                if not self._authenticated(ctrl, nonce):
                    log.warning("kv pair refused: the peer did not prove the pool's secret", peer=str(addr))
                    ctrl.send({"kind": "kv_refused", "v": WIRE_VERSION, "error": "no valid proof of the pool's secret"})
                    return
                ctrl.max_frame_bytes = MAX_FRAME_BYTES
                # the store prefix: unguessable, and sent only to the peer that proved itself
                group_id = f"{pair_id}-{secrets.token_hex(16)}"
                ctrl.send({"kind": "kv_welcome", "v": WIRE_VERSION, "pair_id": group_id})
                group = make_group(self._store.port, group_id, DECODE_RANK, self._backend, self._host,
                                    self._timeout_s)
                warm_up(group, DECODE_RANK, device, self._timeout_s, proof(self._secret, nonce, b"group"))
                with on_stream(torch.cuda.Stream(device) if device.type == "cuda" else None):
                    self._receive_loop(group, ctrl, conn)
        except Exception as exc:  # this pair is over (peer gone, broken frame); the pool is not
            log.info("kv pair closed", pair_id=pair_id, error=str(exc)[:300])
        abort_later(group)  # the pair is over either way: free its communicator, end any posted receive

    def _authenticated(self, ctrl: Frames, nonce: bytes) -> bool:
        """Send the nonce; True once the one frame that answers it carries its HMAC."""
        ctrl.send({"kind": "kv_hello", "v": WIRE_VERSION, "nonce": nonce})
        frames = ctrl.wait(self._stop, time.monotonic() + self._timeout_s)
        if len(frames) != 1 or not isinstance(frames[0], dict):
            return False
        answer = frames[0]
        shown = answer.get("proof")
        return (answer.get("kind") == "kv_auth" and answer.get("v") == WIRE_VERSION and isinstance(shown, bytes)
                and hmac.compare_digest(shown, proof(self._secret, nonce, b"ctrl")))

    def _receive_loop(self, group, ctrl: Frames, conn: socket.socket) -> None:
        """Receives run ahead of the scatters: while chunk i's payload lands and is
        scattered, the receives of the next chunks are already posted."""
        headers: collections.deque[dict] = collections.deque()
        receiving: collections.deque[_Chunk] = collections.deque()
        applying: collections.deque[_Chunk] = collections.deque()
        progressed_at = time.monotonic()
        while not self._stop.is_set():
            busy = bool(headers or receiving or applying)
            conn.settimeout(0 if busy else POLL_S)  # idle: block on the socket; busy: poll the device
            ctrl.flush()
            for header in ctrl.received():
                if header.get("kind") == "kv_bye":
                    return
                if not busy:
                    progressed_at = time.monotonic()  # a new burst: spin, do not sleep
                headers.append(header)
                self._mark(header, "header")
            while headers and len(receiving) < MAX_AHEAD and (
                not receiving or sum(c.payload.numel() for c in receiving) + _num_bytes(headers[0]) <= MAX_AHEAD_BYTES
            ):
                receiving.append(self._post(group, headers.popleft()))
                self._mark(receiving[-1], "posted")
            progressed = False
            while receiving and self._landed(receiving[0]):
                chunk = receiving.popleft()
                self._mark(chunk, "landed")
                self._apply(chunk, ctrl)
                self._mark(chunk, "scatter_enqueued")
                applying.append(chunk)
                progressed = True
            if receiving and time.monotonic() > receiving[0].deadline:
                raise TransferError("a KV payload did not arrive in time")
            while applying and (applying[0].applied is None or applying[0].applied.query()):
                chunk = applying.popleft()
                self._forget(chunk)
                ctrl.send({"kind": "kv_ack", "v": WIRE_VERSION, "seq": chunk.header.get("seq"),
                           "error": chunk.error})
                self._mark(chunk, "acked")
                progressed = True
            now = time.monotonic()
            if progressed:
                progressed_at = now
            elif busy:  # yield the GIL to the worker loop; sleep only once nothing moved for a while
                time.sleep(0 if now - progressed_at < SPIN_S else 1e-4)

    def _post(self, group, header: dict) -> _Chunk:
        """Post the receive of one announced payload (a bad header's payload is drained too)."""
        error = self._check(header)
        num_bytes = header.get("num_bytes")
        if error is not None and not (isinstance(num_bytes, int) and 0 < num_bytes <= self._kv.nbytes):
            raise TransferError(f"unreadable chunk header {header!r}: {error}")  # cannot resync: drop the pair
        payload = torch.empty(num_bytes, dtype=torch.uint8, device=self._kv.device)
        work = group.recv([payload], PREFILL_RANK, PAYLOAD_TAG)
        if not self._kv.is_cuda:
            work.wait()  # gloo: the bytes are here once this returns
        return _Chunk(header, error, payload, work, time.monotonic() + self._timeout_s)

    def _landed(self, chunk: _Chunk) -> bool:
        return not self._kv.is_cuda or chunk.work.is_completed()

    def _apply(self, chunk: _Chunk, ctrl: Frames) -> None:
        """Scatter a landed payload into its blocks, if they are still granted."""
        if chunk.error is not None:
            return  # drained, so the next chunk still lines up
        if ctrl.peer_gave_up():  # its PrefillDone("failed") may be on the way: the blocks are not ours
            raise TransferError("the sender closed the pair before its chunk was applied")
        kv, header = self._kv, chunk.header
        dst_block_ids, handoff = header["dst_block_ids"], header.get("handoff")
        index = torch.tensor(dst_block_ids, dtype=torch.long).to(kv.device)  # before the lock: may wait
        with self._lock:
            if handoff is not None and not self._grants.get(handoff, frozenset()).issuperset(dst_block_ids):
                chunk.error = f"handoff {handoff} holds no grant for blocks {dst_block_ids}"
                return
            if kv.is_cuda:
                chunk.work.wait()  # this stream after the receive (it already ran)
            staging = chunk.payload.view(kv.dtype).view(kv.shape[0], 2, len(dst_block_ids), *kv.shape[3:])
            ops.scatter_blocks(kv, index, staging)
            if kv.is_cuda:
                chunk.applied = torch.cuda.Event()
                chunk.applied.record()
                if handoff is not None:
                    chunk.handoff = handoff
                    self._scattering[handoff].append(chunk.applied)

    def _forget(self, chunk: _Chunk) -> None:
        chunk.payload = chunk.work = None
        if chunk.handoff is not None:
            with self._lock:
                events = self._scattering.get(chunk.handoff)
                if events is not None and chunk.applied in events:
                    events.remove(chunk.applied)
                    if not events:
                        del self._scattering[chunk.handoff]

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
