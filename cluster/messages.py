"""Wire messages: named, versioned dataclasses encoded as msgpack maps.

Every message carries ``kind`` (its type name) and ``v`` (schema version). No
pickle and no positional frames: a reader looks fields up by name, ignores
fields it does not know, and rejects a kind or version it cannot read.

Streams carry one message per entry under the field ``m``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from tandem.cluster.sampling import SamplingParams

VERSION = 1
FIELD = b"m"  # the stream-entry field holding a packed message


class MessageError(ValueError):
    """A message that cannot be decoded: unknown kind, newer version, bad map."""


_REGISTRY: dict[str, type] = {}


def message(cls):
    """Class decorator: make a frozen-less dataclass and register it by name."""
    cls = dataclass(cls)
    cls.kind = cls.__name__
    _REGISTRY[cls.__name__] = cls
    return cls


def _to_wire(value: Any) -> Any:
    if isinstance(value, SamplingParams):
        return dataclasses.asdict(value)
    return value


def encode(msg: Any) -> bytes:
    body = {f.name: _to_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    body["kind"] = msg.kind
    body["v"] = VERSION
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Any:
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable message: {exc}") from exc
    if not isinstance(body, dict):
        raise MessageError("message is not a map")
    kind, version = body.pop("kind", None), body.pop("v", None)
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message kind {kind!r}")
    if not isinstance(version, int) or version > VERSION:
        raise MessageError(f"{kind} version {version!r} is newer than {VERSION}")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in body.items() if k in names}
    if "sampling" in kwargs:
        kwargs["sampling"] = _sampling(kwargs["sampling"])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"bad {kind}: {exc}") from exc


def _sampling(value: Any) -> SamplingParams:
    """Sampling settings off the wire; fields this version does not know (a newer sender's) are
    dropped, as a message's unknown fields are."""
    if not isinstance(value, dict):
        raise MessageError(f"sampling is not a map: {type(value).__name__}")
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in value.items() if k in names})


@message
class GenerateRequest:
    """Gateway -> decode worker inbox: a new request, already validated and tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    reply_to: str = ""  # the output stream of the gateway that submitted it (keys.gateway_output)
    # tokens already generated elsewhere: a request resumed after its decode worker was lost
    # (its KV is recomputed over prompt + these but the last, and decoding goes on from there)
    output_token_ids: list[int] = field(default_factory=list)
    kind: ClassVar[str]


@message
class AbortRequest:
    """Gateway -> decode, decode -> prefill: stop working on a request."""

    request_id: str
    reason: str = "abort"
    kind: ClassVar[str]


@message
class PrefillJob:
    """Decode -> prefill inbox: compute this prompt's KV into my blocks.

    ``kv_endpoint`` says how to reach the decode worker's KV pool (the
    transport's own map); ``dst_block_ids`` are the preallocated destination
    blocks, in order, covering at least the prompt. With ``resume`` the
    prompt is a paused request's prompt + output tokens but the last: the KV
    is computed and transferred, and PrefillDone("ok") carries no first token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    dst_block_ids: list[int]
    kv_endpoint: dict
    decode_worker_id: str
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    reply_to: str = ""
    resume: bool = False  # a paused request's KV is recomputed: no first token is sampled or published
    handoff_id: str = ""  # this dispatch's grant on the decode side's pool (transports that check one)
    kind: ClassVar[str]


@message
class PrefillDone:
    """Prefill -> decode inbox: the prompt's KV is in place (or is not, and why).

    status: "ok" (first_token set; the prefill worker no longer touches the
    destination blocks), "aborted" or "failed" (error set). After any status the
    prefill worker owns none of the destination blocks.
    """

    request_id: str
    status: str
    first_token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    prefill_worker_id: str = ""  # who sends it: a reply from an earlier dispatch is recognised and ignored
    handoff_id: str = ""  # the PrefillJob's it answers: told apart even from the same worker's earlier job
    kind: ClassVar[str]


@message
class TokenEvent:
    """Worker -> the request's output stream: tokens at output index ``index``.

    The last event of a request has ``finish_reason`` set ("stop", "length",
    "abort" or "error"; error carries the message).
    """

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    # with SamplingParams.logprobs: one engine.logprobs entry per token of token_ids
    logprobs: list | None = None
    kind: ClassVar[str]


@message
class TokenBatch:
    """Worker -> a gateway's output stream: one step's TokenEvents for that gateway's requests."""

    events: list[bytes]  # each an encoded TokenEvent
    kind: ClassVar[str]

    @classmethod
    def of(cls, events: list["TokenEvent"]) -> "TokenBatch":
        return cls([encode(e) for e in events])

    def unpack(self) -> list["TokenEvent"]:
        return [decode(raw) for raw in self.events]


@message
class WorkerInfo:
    """A worker's registry record, refreshed with every heartbeat."""

    worker_id: str
    role: str  # "prefill" | "decode"
    model: str
    inbox: str
    pid: int
    host: str
    started_at: float
    heartbeat_at: float
    num_total_blocks: int
    num_free_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    block_size: int = 16
    max_seq_len: int = 0
    kv_endpoint: dict = field(default_factory=dict)
    capacity_scheduler_policy: str = ""  # decode: the policy it admits under now
    max_batch_size: int = 0  # decode: most requests it holds admitted (0: no limit)
    num_preemptions: int = 0  # decode: requests paused since it started (monotonic)
    device: str = ""  # what it computes on, the same string for the same GPU in any process ("" unknown)
    pid_namespace: int = 0  # its PID namespace (0 unknown): ``pid`` means something only within it
    kind: ClassVar[str]
