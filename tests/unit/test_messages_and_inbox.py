"""Wire messages and inboxes under bad input and Redis faults: an unreadable entry is dropped
(the worker goes on), a newer sender's sampling fields are ignored, a Redis restarted without
its data gets the inbox's consumer group back, read entries are deleted, and control messages
sent during an outage arrive, in order, once Redis is back."""

import msgpack
import pytest
import redis

from tandem.cluster import keys
from tandem.cluster.inbox import Inbox, Mailer, send
from tandem.redis_server import RedisServer, free_port
from tandem.cluster.messages import AbortRequest, GenerateRequest, MessageError, PrefillDone, TokenBatch, decode, encode
from tandem.cluster.sampling import SamplingParams


def _request(**sampling):
    return GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(**sampling),
                           max_tokens=4, reply_to="gw")


def _raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def test_a_newer_senders_sampling_fields_are_ignored():
    body = msgpack.unpackb(encode(_request(temperature=0.5)), raw=False)
    body["sampling"]["a_later_knob"] = 0.1  # a field this version does not know
    msg = decode(_raw(body))
    assert isinstance(msg, GenerateRequest) and msg.sampling == SamplingParams(temperature=0.5)


@pytest.mark.parametrize("change", [
    {"sampling": [0.5]},  # not a map
    {"kind": ["GenerateRequest"]},  # an unhashable kind
    {"kind": "NoSuchMessage"},
    {"v": 99},  # newer than this version
    {"prompt_token_ids": None, "request_id": None, "max_tokens": None, "reply_to": None},  # required ones missing
])
def test_unreadable_messages_raise_message_error_only(change):
    body = {**msgpack.unpackb(encode(_request()), raw=False), **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(MessageError):
        decode(_raw(body))


@pytest.fixture
def server():
    server = RedisServer(free_port())
    yield server
    server.stop()


def test_inbox_deletes_what_it_read_and_drops_junk(server):
    client = redis.Redis.from_url(server.url)
    inbox = Inbox(client, keys.inbox("decode", "d0"), "d0")
    send(client, inbox.stream, AbortRequest("a"))
    client.xadd(inbox.stream, {b"m": b"\xc1junk"})
    send(client, inbox.stream, AbortRequest("b"))
    assert [m.request_id for m in inbox.read(block_ms=None)] == ["a", "b"]
    assert client.xlen(inbox.stream) == 0  # no prompt stays in Redis once delivered
    assert inbox.read(block_ms=None) == []


def test_inbox_gets_its_group_back_after_redis_lost_its_data(server):
    client = redis.Redis.from_url(server.url)
    inbox = Inbox(client, keys.inbox("prefill", "p0"), "p0")
    client.flushall()  # what a restart without persistence leaves: no stream, no group
    assert inbox.read(block_ms=None) == []  # NOGROUP: recreated, not an endless error
    send(client, inbox.stream, AbortRequest("after"))
    assert [m.request_id for m in inbox.read(block_ms=None)] == ["after"]


def test_mailer_keeps_messages_across_an_outage_and_sends_them_in_order():
    port = free_port()
    server = RedisServer(port)
    client = redis.Redis(port=port, socket_timeout=2)
    stream = keys.inbox("decode", "d0")
    mailer = Mailer(client)
    try:
        mailer.send(stream, PrefillDone("r0", "ok", 5, None, None))
        server.stop()
        for i in (1, 2):
            with pytest.raises(redis.RedisError):
                mailer.send(stream, PrefillDone(f"r{i}", "ok", 5, None, None))
        assert mailer.num_pending == 2
        server = RedisServer(port)  # back, empty
        client.connection_pool.disconnect()
        mailer.flush()
        assert mailer.num_pending == 0
        assert [decode(f[b"m"]).request_id for _id, f in client.xrange(stream)] == ["r1", "r2"]
    finally:
        server.stop()


def test_output_mux_drops_an_ill_typed_batch_and_goes_on():
    from tandem.gateway.mux import OutputMux

    mux = object.__new__(OutputMux)
    mux._queues = {}
    bad = msgpack.unpackb(encode(TokenBatch.of([])), raw=False)
    bad["events"] = 5  # well-formed message, ill-typed field
    mux._dispatch("1-0", {b"m": _raw(bad)})  # logged and dropped, not raised into the read loop
