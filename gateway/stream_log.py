"""A resumable stream's side in Redis: its events, its request, its producer's lease.

Three keys per stream (``tandem.cluster.keys``):

- ``sse_log(id)``: the events, a Redis stream whose entry ids are ``0-<seq + 1>``, so
  "the events after seq k" is one XREAD from ``0-<k + 1>``. Each entry holds the event as
  sent (``data:`` and ``id:`` lines), the output token ids it is the first to carry (tokens
  of deltas that sent nothing ride with the next event), and the stream's position after it
  (``responses.StreamPosition``).
- ``sse_request(id)``: a hash with what any gateway needs to continue the request (the
  ``RetainedRequest``), the next seq, the decode worker and wire id it runs under, and the
  first wire seq of its current producer (each takeover moves it past every wire id the
  producer before could have used, failovers included, so no wire id is used twice).
- ``sse_lease(id)``: the producing gateway's id, with a TTL of ``LEASE_S`` that it renews
  every ``LEASE_RENEW_S`` while it streams; gone means the producer is gone.

An event is appended only by the lease's holder and only with the next seq (one Lua script
checks both), so a gateway that lost its lease (paused past the TTL, cut off from Redis)
cannot add an event after another gateway took the stream over: no event is ever repeated
or missing. Each append and renewal refreshes the retention TTL (``--stream-retention-s``)
of the log and the hash.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from tandem.cluster import keys
from tandem.cluster.sampling import SamplingParams
from tandem.gateway.validation import GenerationInput

LEASE_S = 3.0  # a producer not heard of for this long is taken for gone
LEASE_RENEW_S = 1.0
READ_COUNT = 256

# KEYS: lease, log, request. ARGV: owner, lease_ms, retention_ms, seq, frame, tokens, state, done,
# worker, wire
_APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local seq = tonumber(ARGV[4])
if tonumber(redis.call('HGET', KEYS[3], 'next')) ~= seq then return -1 end
redis.call('XADD', KEYS[2], '0-' .. (seq + 1), 'frame', ARGV[5], 'tokens', ARGV[6], 'state', ARGV[7],
           'done', ARGV[8])
redis.call('HSET', KEYS[3], 'next', seq + 1, 'worker', ARGV[9], 'wire', ARGV[10])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return 1
"""

# KEYS: lease, log, request. ARGV: owner, lease_ms, retention_ms
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return 1
"""

# KEYS: lease. ARGV: owner
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lease, request. ARGV: owner, lease_ms, wire seqs a producer may use. Only a stream still
# retained can be taken; returns the new producer's first wire seq (0: not taken).
_ACQUIRE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
return redis.call('HINCRBY', KEYS[2], 'wire_seq', ARGV[3])
"""


@dataclass
class RetainedRequest:
    """What a gateway needs to continue a resumable stream it did not start."""

    request_id: str
    chat: bool  # the endpoint: chat.completion chunks, else text_completion
    created: int
    model: str
    inp: GenerationInput
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    arrival_time: float  # wall clock: the workers order their queues by it

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "RetainedRequest":
        d = json.loads(text)
        inp = dict(d["inp"])
        inp["sampling"] = SamplingParams(**inp["sampling"])
        d["inp"] = GenerationInput(**inp)
        return cls(**d)


@dataclass
class LoggedEvent:
    seq: int
    frame: bytes  # as sent: data and id lines
    token_ids: list[int]  # output tokens this event is the first to carry
    state: dict  # the stream's position after it (StreamPosition.to_dict) and its cached prompt tokens
    done: bool  # the stream's last event ([DONE])


@dataclass
class StreamRecord:
    """A retained stream as a takeover reads it."""

    request: RetainedRequest
    events: list[LoggedEvent]
    next_seq: int
    worker_id: str  # the decode worker the last producer's wire id runs on
    wire_id: str
    wire_seq: int  # the current producer's first wire seq

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].done


class StreamLog:
    def __init__(self, client: aioredis.Redis, owner: str, retention_s: float, lease_s: float = LEASE_S):
        """``owner``: this gateway's id, the lease's value while it produces a stream."""
        self._client = client
        self.owner = owner
        self._retention_ms = max(int(retention_s * 1000), 1)
        self._lease_ms = int(lease_s * 1000)
        self._append = client.register_script(_APPEND)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._acquire = client.register_script(_ACQUIRE)

    @staticmethod
    def _keys(request_id: str) -> list[str]:
        return [keys.sse_lease(request_id), keys.sse_log(request_id), keys.sse_request(request_id)]

    async def create(self, request: RetainedRequest, worker_id: str, wire_id: str) -> None:
        """Retain a new stream, this gateway holding its lease (its wire seqs from 0)."""
        rid = request.request_id
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(keys.sse_request(rid), mapping={"request": request.to_json(), "next": 0, "worker": worker_id,
                                                  "wire": wire_id, "wire_seq": 0})
        pipe.pexpire(keys.sse_request(rid), self._retention_ms)
        pipe.set(keys.sse_lease(rid), self.owner, px=self._lease_ms)
        await pipe.execute()

    async def append(self, request_id: str, event: LoggedEvent, worker_id: str, wire_id: str) -> bool:
        """Add the stream's next event; False when this gateway no longer holds the lease (or the
        seq is not the next one): it must stop producing."""
        args = [self.owner, self._lease_ms, self._retention_ms, event.seq, event.frame,
                json.dumps(event.token_ids), json.dumps(event.state, separators=(",", ":")),
                "1" if event.done else "", worker_id, wire_id]
        return await self._append(keys=self._keys(request_id), args=args) == 1

    async def renew(self, request_id: str) -> bool:
        """Extend the lease (and the retention); False when it is not this gateway's any more."""
        return await self._renew(keys=self._keys(request_id),
                                 args=[self.owner, self._lease_ms, self._retention_ms]) == 1

    async def release(self, request_id: str) -> None:
        """Give the lease up (if it is still ours): the stream ended, or this gateway stopped producing it."""
        await self._release(keys=[keys.sse_lease(request_id)], args=[self.owner])

    async def acquire(self, request_id: str, num_wire_seqs: int) -> bool:
        """Take the lease of a retained stream nobody holds (SET NX): True when this gateway got it;
        its wire seqs (``StreamRecord.wire_seq`` on) then follow the ``num_wire_seqs`` the producer
        before could use."""
        first = await self._acquire(keys=[keys.sse_lease(request_id), keys.sse_request(request_id)],
                                    args=[self.owner, self._lease_ms, num_wire_seqs])
        return bool(first)

    async def set_worker(self, request_id: str, worker_id: str, wire_id: str) -> None:
        """Where the request runs now (a takeover's resubmission, before its first event)."""
        await self._client.hset(keys.sse_request(request_id), mapping={"worker": worker_id, "wire": wire_id})

    async def lease_holder(self, request_id: str) -> str | None:
        holder = await self._client.get(keys.sse_lease(request_id))
        return holder.decode() if isinstance(holder, bytes) else holder

    async def describe(self, request_id: str) -> tuple[int, bool] | None:
        """(next seq, whether the last event was sent) of a retained stream; None: unknown or expired."""
        pipe = self._client.pipeline(transaction=False)
        pipe.hget(keys.sse_request(request_id), "next")
        pipe.xrevrange(keys.sse_log(request_id), count=1)
        next_seq, last = await pipe.execute()
        if next_seq is None:
            return None
        return int(next_seq), bool(last) and _event(*last[0]).done

    async def exists(self, request_id: str) -> bool:
        return bool(await self._client.exists(keys.sse_request(request_id)))

    async def read(self, request_id: str, after_seq: int, block_ms: int | None = None) -> list[LoggedEvent]:
        """The events after ``after_seq`` (-1: from the first), waiting up to ``block_ms`` for one."""
        reply = await self._client.xread({keys.sse_log(request_id): f"0-{after_seq + 1}"}, count=READ_COUNT,
                                         block=block_ms)
        return [_event(entry_id, fields) for _stream, entries in reply or [] for entry_id, fields in entries]

    async def load(self, request_id: str) -> StreamRecord | None:
        """Everything retained of a stream (for a takeover); None: unknown or expired."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hgetall(keys.sse_request(request_id))
        pipe.xrange(keys.sse_log(request_id))
        meta, entries = await pipe.execute()
        if not meta or b"request" not in meta:
            return None
        return StreamRecord(
            request=RetainedRequest.from_json(meta[b"request"]),
            events=[_event(entry_id, fields) for entry_id, fields in entries],
            next_seq=int(meta[b"next"]),
            worker_id=meta[b"worker"].decode(),
            wire_id=meta[b"wire"].decode(),
            wire_seq=int(meta[b"wire_seq"]),
        )


def _event(entry_id, fields: dict) -> LoggedEvent:
    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return LoggedEvent(seq=int(entry_id.split("-")[1]) - 1, frame=fields[b"frame"],
                       token_ids=json.loads(fields[b"tokens"]), state=json.loads(fields[b"state"]),
                       done=bool(fields[b"done"]))
