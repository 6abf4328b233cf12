"""Wire messages: named, versioned dataclasses encoded as msgpack maps.

Every message carries ``kind`` (its type name) and ``v`` (schema version). No
pickle and no positional frames: a reader looks fields up by name, ignores
fields it does not know, and rejects a kind or version it cannot read.

Every field has a rule (``rules``, beside the fields; the rules themselves and
``MessageError`` are ``tandem.cluster.wire_rules``) that ``decode`` checks:
its type and its range. A message that decodes is one a worker can hold without
a type error anywhere later; what needs a worker's own state (its vocabulary,
max_seq_len, the peer's pool size) the worker checks itself. Anything else
raises ``MessageError``, whose ``body`` keeps the map so that the request it
names can still be answered.

Streams carry one message per entry under the field ``m``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from tandem.cluster.sampling import SamplingParams
from tandem.cluster.wire_rules import (
    BOOL, BYTE_STRINGS, ID, INT64, LOGPROBS, PROMPT_LOGPROBS, SAMPLING, STR_MAP, TOKEN, MessageError, Rule,
    describe, ids, integer, is_int, number, optional, text,
)

VERSION = 1
FIELD = b"m"  # the stream-entry field holding a packed message
FINISH_REASONS = ("stop", "length", "abort", "error")
PREFILL_STATUSES = ("ok", "aborted", "failed")


# ---- encoding -------------------------------------------------------------------------------

_REGISTRY: dict[str, type] = {}


def message(cls):
    """Class decorator: make a frozen-less dataclass and register it by name; every field must
    have its rule."""
    cls = dataclass(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if set(cls.rules) != names:
        raise TypeError(f"{cls.__name__}: fields without a rule {sorted(names - set(cls.rules))}, "
                        f"rules without a field {sorted(set(cls.rules) - names)}")
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
    """bytes -> a message whose every field passed its rule; MessageError otherwise (only)."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable message: {exc}") from exc
    if not isinstance(body, dict):
        raise MessageError(f"message is not a map: {type(body).__name__}")
    try:
        return _from_map(body)
    except MessageError as exc:
        exc.body = body
        raise


def _from_map(body: dict) -> Any:
    kind, version = body.get("kind"), body.get("v")
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message kind {describe(kind)}")
    if not is_int(version) or version < 1:
        raise MessageError(f"{kind} has no readable version: {describe(version)}")
    if version > VERSION:
        raise MessageError(f"{kind} version {version} is newer than {VERSION}")
    kwargs = {name: rule.take(body[name], f"{kind}.{name}") for name, rule in cls.rules.items() if name in body}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise MessageError(f"{kind} lacks {', '.join(missing)}")
    return cls(**kwargs)


def named(body: dict, name: str) -> str | None:
    """A field of an undecodable message's map, when it is a non-empty string (what the map names)."""
    value = body.get(name)
    return value if isinstance(value, str) and value else None


# ---- the messages ---------------------------------------------------------------------------

@message
class GenerateRequest:
    """Gateway -> decode worker inbox: a new request, already validated and tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # 0: the prompt is only scored (its prompt logprobs), nothing is generated
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    reply_to: str = ""  # the output stream of the gateway that submitted it (keys.gateway_output)
    # tokens already generated elsewhere: a request resumed after its decode worker was lost
    # (its KV is recomputed over prompt + these but the last, and decoding goes on from there)
    output_token_ids: list[int] = field(default_factory=list)
    # the LoRA adapter the request runs with ("": the base model): its name, the PEFT directory
    # every worker reads it from, and the digest of its weights (engine.lora_adapter) that a
    # worker's copy must have
    lora_name: str = ""
    lora_path: str = ""
    lora_digest: str = ""
    kind: ClassVar[str]
    rules: ClassVar[dict[str, Rule]] = {
        "request_id": ID, "prompt_token_ids": ids(nonempty=True), "sampling": SAMPLING,
        "max_tokens": integer(0), "stop_token_ids": ids(), "ignore_eos": BOOL, "priority": INT64,
        "arrival_time": number(), "reply_to": text(), "output_token_ids": ids(),
        "lora_name": text(), "lora_path": text(), "lora_digest": text(),
    }


@message
class AbortRequest:
    """Gateway -> decode, decode -> prefill: stop working on a request."""

    request_id: str
    reason: str = "abort"
    kind: ClassVar[str]
    rules: ClassVar[dict[str, Rule]] = {"request_id": ID, "reason": text()}


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
    lora_name: str = ""  # the request's adapter (GenerateRequest's three fields, passed on)
    lora_path: str = ""
    lora_digest: str = ""
    kind: ClassVar[str]
    rules: ClassVar[dict[str, Rule]] = {
        "request_id": ID, "prompt_token_ids": ids(nonempty=True), "sampling": SAMPLING,
        "max_tokens": integer(0), "dst_block_ids": ids(nonempty=True), "kv_endpoint": STR_MAP,
        "decode_worker_id": ID, "stop_token_ids": ids(), "ignore_eos": BOOL, "priority": INT64,
        "arrival_time": number(), "reply_to": text(), "resume": BOOL, "handoff_id": text(),
        "lora_name": text(), "lora_path": text(), "lora_digest": text(),
    }


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
    rules: ClassVar[dict[str, Rule]] = {
        "request_id": ID, "status": text(choices=PREFILL_STATUSES), "first_token": optional(TOKEN),
        "finish_reason": optional(text(choices=FINISH_REASONS)), "error": optional(text()),
        "prefill_worker_id": text(), "handoff_id": text(),
    }


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
    # with SamplingParams.prompt_logprobs, on the prefill worker's event (index 0): one
    # engine.prompt_logprobs entry per prompt token, the first None
    prompt_logprobs: list | None = None
    kind: ClassVar[str]
    rules: ClassVar[dict[str, Rule]] = {
        "request_id": ID, "index": integer(), "token_ids": ids(),
        "finish_reason": optional(text(choices=FINISH_REASONS)), "error": optional(text()),
        "num_cached_tokens": integer(), "logprobs": optional(LOGPROBS), "prompt_logprobs": optional(PROMPT_LOGPROBS),
    }


@message
class TokenBatch:
    """Worker -> a gateway's output stream: one step's TokenEvents for that gateway's requests."""

    events: list[bytes]  # each an encoded TokenEvent
    kind: ClassVar[str]
    rules: ClassVar[dict[str, Rule]] = {"events": BYTE_STRINGS}  # each checked as it is unpacked

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
    max_batch_size: int = 0  # decode: most requests in one step's batch (0: no limit)
    max_admitted: int = 0  # decode: most requests it holds admitted, running and waiting (0: max_batch_size)
    num_preemptions: int = 0  # decode: requests paused since it started (monotonic)
    num_swaps_out: int = 0  # decode, with a host KV tier: paused requests whose KV went to host memory
    num_swaps_in: int = 0  # decode: paused requests resumed from host memory, with no prefill
    device: str = ""  # what it computes on, the same string for the same GPU in any process ("" unknown)
    computes_prompts: bool = False  # decode: runs both pools (tandem.colocated), needs no prefill worker
    num_mixed_steps: int = 0  # decode, computing its prompts: steps that carried decode rows and prompt chunks
    pid_namespace: int = 0  # its PID namespace (0 unknown): ``pid`` means something only within it
    num_restarts: int = 0  # times its supervisor restarted it (its --restarts setting)
    heartbeat_ttl_s: float = 0.0  # how long its record lives without a beat (0 unknown)
    heartbeat_interval_s: float = 0.0  # how often it beats (0 unknown)
    liveness_channel: str = ""  # the channel its process stays subscribed to ("" none: tandem.cluster.liveness)
    # prefill, with --kv-host-cache-gb: its host KV tier (blocks it holds, of how many; running totals)
    prefix_device_hits: int = 0  # prompt blocks taken from its device prefix cache (running total)
    host_tier_blocks: int = 0
    host_tier_capacity: int = 0
    host_tier_hits: int = 0  # blocks copied back to the device for a prompt (prefix hits from the host)
    host_tier_evictions: int = 0  # host blocks dropped for room
    host_tier_bytes_out: int = 0  # device -> host
    host_tier_bytes_in: int = 0  # host -> device
    kind: ClassVar[str]
    rules: ClassVar[dict[str, Rule]] = {
        "worker_id": ID, "role": text(choices=("prefill", "decode")), "model": text(), "inbox": text(),
        "pid": integer(), "host": text(), "started_at": number(), "heartbeat_at": number(),
        "num_total_blocks": integer(), "num_free_blocks": integer(), "num_running": integer(),
        "num_waiting": integer(), "block_size": integer(1), "max_seq_len": integer(), "kv_endpoint": STR_MAP,
        "capacity_scheduler_policy": text(), "max_batch_size": integer(), "max_admitted": integer(), "num_preemptions": integer(), "num_swaps_out": integer(0), "num_swaps_in": integer(0),
        "device": text(), "computes_prompts": BOOL, "num_mixed_steps": integer(0), "pid_namespace": integer(), "num_restarts": integer(), "heartbeat_ttl_s": number(),
        "heartbeat_interval_s": number(lo=0.0), "liveness_channel": text(),
        "prefix_device_hits": integer(0), "host_tier_blocks": integer(0), "host_tier_capacity": integer(0), "host_tier_hits": integer(0),
        "host_tier_evictions": integer(0), "host_tier_bytes_out": integer(0), "host_tier_bytes_in": integer(0),
    }
