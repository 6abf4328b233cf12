"""Who may pair with a decode worker's nccl endpoint (gloo on the CPU): only a peer that proves
the pool's secret, on the control socket and again in the process group; anyone else is closed
and its bytes never reach the pool; an oversized control frame closes the connection."""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import pytest
import torch

from tandem.engine.kv_cache import KVCachePool
from tandem.kvtransfer import KVPoll, KVSender
from tandem.kvtransfer.base import TransferError
from tandem.kvtransfer.nccl import NcclTransport
from tandem.kvtransfer.nccl_pair import (
    HANDSHAKE_FRAME_BYTES, MAX_FRAME_BYTES, POLL_S, PREFILL_RANK, WIRE_VERSION, Frames, make_group, proof, warm_up,
)

LAYOUT = dict(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
TIMEOUT_S = 3.0


@pytest.fixture
def decode_side():
    pool = KVCachePool(**LAYOUT, dtype=torch.float32)
    transport = NcclTransport(timeout_s=TIMEOUT_S)
    endpoint = transport.export_pool(pool)
    yield pool, endpoint
    transport.close()


def _control(endpoint) -> Frames:
    sock = socket.create_connection((endpoint["host"], endpoint["ctrl_port"]), timeout=5)
    sock.settimeout(POLL_S)
    return Frames(sock)


def _until_closed(ctrl: Frames, timeout_s: float = 10.0) -> list[dict]:
    """Every frame the decode side sends before it closes the connection (fails if it never does)."""
    frames, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            frames += ctrl.received()
        except (ConnectionError, OSError):
            return frames
    raise AssertionError(f"the decode side kept the connection open; it sent {frames}")


def _hello(ctrl: Frames) -> bytes:
    hello = ctrl.wait(_never(), time.monotonic() + 5)
    assert hello[0]["kind"] == "kv_hello" and hello[0]["v"] == WIRE_VERSION
    return hello[0]["nonce"]


def _never() -> threading.Event:
    return threading.Event()


def _chunk_header(block_ids: list[int], num_bytes: int) -> dict:
    return {"kind": "kv_chunk", "v": WIRE_VERSION, "seq": 1, "dst_block_ids": block_ids, "handoff": None,
            "num_bytes": num_bytes}


def _pair(endpoint, ctrl_proof=None, group_proof=None):
    """A peer that forms a pair by hand: (control frames, process group); the proofs default
    to the right ones."""
    secret = bytes.fromhex(endpoint["secret"])
    ctrl = _control(endpoint)
    nonce = _hello(ctrl)
    ctrl.send({"kind": "kv_auth", "v": WIRE_VERSION, "proof": ctrl_proof or proof(secret, nonce, b"ctrl")})
    welcome = ctrl.wait(_never(), time.monotonic() + 5)
    assert welcome[0]["kind"] == "kv_welcome", welcome
    group = make_group(endpoint["store_port"], welcome[0]["pair_id"], PREFILL_RANK, "gloo", endpoint["host"],
                       TIMEOUT_S)
    warm_up(group, PREFILL_RANK, torch.device("cpu"), TIMEOUT_S, group_proof or proof(secret, nonce, b"group"))
    return ctrl, group


def test_a_peer_without_the_secret_is_refused(decode_side):
    pool, endpoint = decode_side
    block_bytes = pool.bytes_per_block
    ctrl = _control(endpoint)  # a wrong proof
    _hello(ctrl)
    ctrl.send({"kind": "kv_auth", "v": WIRE_VERSION, "proof": b"\0" * 32})
    assert [f["kind"] for f in _until_closed(ctrl)] == ["kv_refused"]
    ctrl = _control(endpoint)  # no proof at all: a chunk header straight away
    _hello(ctrl)
    ctrl.send(_chunk_header([0, 1], 2 * block_bytes))
    assert [f["kind"] for f in _until_closed(ctrl)] == ["kv_refused"]
    ctrl = _control(endpoint)  # the right proof for another nonce (a replay)
    _hello(ctrl)
    ctrl.send({"kind": "kv_auth", "v": WIRE_VERSION,
               "proof": proof(bytes.fromhex(endpoint["secret"]), b"\1" * 32, b"ctrl")})
    assert [f["kind"] for f in _until_closed(ctrl)] == ["kv_refused"]

    # a real sender that holds another pool's secret: its write fails and lands nowhere
    wrong = {**endpoint, "secret": "ab" * 32}
    sender = KVSender(NcclTransport(timeout_s=TIMEOUT_S).connect(wrong), [0, 1])
    sender.send_blocks(torch.ones(2, 2, 4, 4, 2, 8), [0, 1], 0)
    sender.finish()
    deadline = time.monotonic() + 15
    while sender.poll() is KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.poll() is KVPoll.FAILED and "refused" in sender.error
    assert "ab" * 32 not in sender.error
    with pytest.raises(TransferError, match="without its secret"):
        connection = NcclTransport(timeout_s=TIMEOUT_S).connect({k: v for k, v in endpoint.items() if k != "secret"})
        transfer = connection.write(torch.ones(2, 2, 4, 4, 2, 8), [0], [0])
        while not transfer.done():
            time.sleep(0.01)
    assert torch.count_nonzero(pool.kv) == 0


def test_the_peer_in_the_group_must_prove_the_secret_too(decode_side):
    """One that got in on the control socket but not the one in the process group (the TCPStore
    takes anyone): the pair is closed before any chunk is read."""
    pool, endpoint = decode_side
    ctrl, group = _pair(endpoint, group_proof=b"\0" * 32)
    payload = torch.ones(pool.bytes_per_block, dtype=torch.uint8)
    try:
        ctrl.send(_chunk_header([3], pool.bytes_per_block))
        group.send([payload], 0, 1)
    except (ConnectionError, OSError, RuntimeError):
        pass  # already closed
    _until_closed(ctrl)
    time.sleep(0.2)
    assert torch.count_nonzero(pool.kv) == 0


def test_oversized_control_frames_close_the_connection(decode_side):
    pool, endpoint = decode_side
    ctrl = _control(endpoint)  # before the proof, only a small frame is read
    _hello(ctrl)
    ctrl.sock.sendall(struct.pack(">I", HANDSHAKE_FRAME_BYTES + 1) + b"\0" * 64)
    assert _until_closed(ctrl) == []

    ctrl, group = _pair(endpoint)  # a proper pair: a chunk lands, then a frame past the bound ends it
    payload = torch.full((pool.bytes_per_block,), 7, dtype=torch.uint8)
    ctrl.send(_chunk_header([2], pool.bytes_per_block))
    group.send([payload], 0, 1).wait()
    ack = ctrl.wait(_never(), time.monotonic() + 5)
    assert ack[0]["kind"] == "kv_ack" and ack[0]["error"] is None
    assert torch.count_nonzero(pool.kv[:, :, 2]) > 0
    body = msgpack.packb(_chunk_header(list(range(8)) * (MAX_FRAME_BYTES // 8), 1))
    assert len(body) > MAX_FRAME_BYTES
    ctrl.sock.sendall(struct.pack(">I", len(body)) + body[:1024])  # the length alone decides
    assert _until_closed(ctrl) == []
    assert torch.count_nonzero(pool.kv[:, :, [0, 1, 3, 4, 5, 6, 7]]) == 0
