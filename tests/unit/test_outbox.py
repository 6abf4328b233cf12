"""Token events survive a Redis outage: kept, then delivered in order once Redis is back."""

import pytest
import redis

from tandem.cluster import keys
from tandem.redis_server import RedisServer, free_port
from tandem.cluster.messages import FIELD, TokenEvent, decode
from tandem.cluster.outputs import Outbox


def _read_all(client, stream):
    events = []
    for _id, fields in client.xrange(stream):
        events += decode(fields[FIELD]).unpack()
    return events


def test_events_kept_across_an_outage_arrive_in_order():
    port = free_port()
    server = RedisServer(port)
    client = redis.Redis(port=port, socket_timeout=2)
    stream = keys.gateway_output("gw-test")
    outbox = Outbox(client)
    try:
        outbox.send([(stream, TokenEvent("r1", 0, [5]))])
        server.stop()
        with pytest.raises(redis.RedisError):
            outbox.send([(stream, TokenEvent("r1", 1, [6])), (stream, TokenEvent("r2", 0, [7]))])
        with pytest.raises(redis.RedisError):
            outbox.send([(stream, TokenEvent("r1", 2, [8], "length"))])
        assert outbox.num_pending == 3
        server = RedisServer(port)  # Redis is back (empty: the first entry is gone with the old server)
        client.connection_pool.disconnect()
        outbox.flush()
        assert outbox.num_pending == 0
        got = [(e.request_id, e.index, e.token_ids, e.finish_reason) for e in _read_all(client, stream)]
        assert got == [("r1", 1, [6], None), ("r2", 0, [7], None), ("r1", 2, [8], "length")]
    finally:
        server.stop()
