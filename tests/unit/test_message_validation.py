"""Wire messages are checked by type and range as they are decoded (tandem.cluster.messages):
arbitrary bytes and arbitrary maps of wrong values raise MessageError and nothing else, what
decodes holds the declared types, valid messages round-trip exactly; registry records that do
not decode are skipped and logged once."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from tandem.cluster import keys
from tandem.cluster.messages import (
    _REGISTRY, VERSION, AbortRequest, GenerateRequest, MessageError, PrefillDone, PrefillJob, TokenBatch, TokenEvent,
    WorkerInfo, decode, encode,
)
from tandem.cluster.wire_rules import INT64_MAX, INT64_MIN, SAMPLING_RULES
from tandem.cluster.registry import parse_records
from tandem.cluster.sampling import MAX_LOGPROBS, SamplingParams

# no example database: nothing written into the checkout
FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


# ---- what each declared type means, independent of the rules ---------------------------------

def _is_int(v):
    return type(v) is int


def _conforms(value, annotation: str) -> bool:
    """Whether a decoded field's value has the type its dataclass annotation declares."""
    if annotation.endswith(" | None"):
        return value is None or _conforms(value, annotation[: -len(" | None")])
    return {
        "str": lambda v: type(v) is str,
        "int": _is_int,
        "float": lambda v: (_is_int(v) or type(v) is float) and math.isfinite(v),
        "bool": lambda v: type(v) is bool,
        "dict": lambda v: type(v) is dict and all(type(k) is str for k in v),
        "list": lambda v: type(v) is list,
        "list[int]": lambda v: type(v) is list and all(_is_int(i) and 0 <= i <= INT64_MAX for i in v),
        "list[bytes]": lambda v: type(v) is list and all(type(b) is bytes for b in v),
        "SamplingParams": lambda v: isinstance(v, SamplingParams) and _sampling_conforms(v),
    }[annotation](value)


def _sampling_conforms(p: SamplingParams) -> bool:
    return (_conforms(p.temperature, "float") and p.temperature >= 0
            and _conforms(p.top_p, "float") and 0 < p.top_p <= 1
            and _is_int(p.top_k) and p.top_k >= 0
            and (p.seed is None or (_is_int(p.seed) and INT64_MIN <= p.seed <= INT64_MAX))
            and (p.logprobs is None or (_is_int(p.logprobs) and 0 <= p.logprobs <= MAX_LOGPROBS))
            and _is_int(p.min_tokens) and p.min_tokens >= 0)


def _holds_declared_types(msg) -> bool:
    return all(_conforms(getattr(msg, f.name), f.type) for f in dataclasses.fields(msg))


# ---- values of every shape ----------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # all msgpack carries: wider than int64 above
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.binary(max_size=8),
)
wild = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)), max_leaves=12)


def _valid_values():
    """A valid value per field name, for maps that mix good and bad values."""
    ids = st.lists(st.integers(0, 1000), min_size=1, max_size=6)
    return {
        "request_id": st.sampled_from(["r1", "r-2"]), "prompt_token_ids": ids, "max_tokens": st.integers(1, 64),
        "sampling": st.fixed_dictionaries({}, optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1),
                                                        "top_k": st.integers(0, 50), "seed": st.integers(0, 99)}),
        "stop_token_ids": ids, "ignore_eos": st.booleans(), "priority": st.integers(-5, 5),
        "arrival_time": st.floats(0, 1e9), "reply_to": st.just("tandem:out:gw:g0"), "output_token_ids": ids,
        "reason": st.just("abort"), "dst_block_ids": ids, "kv_endpoint": st.just({"transport": "shm"}),
        "decode_worker_id": st.just("decode-0"), "resume": st.booleans(), "handoff_id": st.just("r1#1"), "lora_name": st.just(""), "lora_path": st.just(""),
        "lora_digest": st.just(""),
        "status": st.sampled_from(["ok", "failed", "aborted"]), "first_token": st.integers(0, 100),
        "finish_reason": st.sampled_from([None, "stop", "length"]), "error": st.none(),
        "prefill_worker_id": st.just("p0"), "index": st.integers(0, 10), "token_ids": ids,
        "num_cached_tokens": st.integers(0, 10), "logprobs": st.none(), "prompt_logprobs": st.none(),
        "events": st.just([]),
        "worker_id": st.just("w0"), "role": st.sampled_from(["decode", "prefill"]), "model": st.just("m"),
        "inbox": st.just("i"), "pid": st.integers(0, 100), "host": st.just("h"), "started_at": st.floats(0, 1e9),
        "heartbeat_at": st.floats(0, 1e9), "num_total_blocks": st.integers(0, 64),
        "num_free_blocks": st.integers(0, 64), "num_running": st.integers(0, 4), "num_waiting": st.integers(0, 4),
        "block_size": st.integers(1, 32), "max_seq_len": st.integers(0, 64), "capacity_scheduler_policy": st.just(""),
        "max_batch_size": st.integers(0, 8), "max_admitted": st.integers(0, 16), "num_preemptions": st.integers(0, 3), "device": st.just("cpu"),
        "computes_prompts": st.booleans(), "num_mixed_steps": st.integers(0, 9), "pid_namespace": st.integers(0, 10), "num_restarts": st.integers(0, 5),
        "heartbeat_ttl_s": st.floats(0, 10), "heartbeat_interval_s": st.floats(0, 5), "liveness_channel": st.text(max_size=40),
        **{name: st.integers(0, 1 << 40) for name in ("num_swaps_out", "num_swaps_in", "prefix_device_hits", "host_tier_blocks", "host_tier_capacity", "host_tier_hits",
                                                       "host_tier_evictions", "host_tier_bytes_out", "host_tier_bytes_in")},
    }


VALID = _valid_values()
sampling_maps = st.dictionaries(st.sampled_from(sorted(SAMPLING_RULES)), wild, max_size=6)  # known fields, any value


def well_formed_maps(kind: str):
    """Maps with the kind's every known field, each a valid value or anything at all (maybe left
    out), plus an unknown field now and then."""
    names = [f.name for f in dataclasses.fields(_REGISTRY[kind])]
    fields = {name: st.one_of(VALID[name], wild, *([sampling_maps] if name == "sampling" else [])) for name in names}
    return st.fixed_dictionaries(
        {"kind": st.just(kind), "v": st.one_of(st.just(VERSION), wild)},
        optional={**fields, "an_unknown_field": wild},
    )


any_map = st.one_of(*(well_formed_maps(kind) for kind in sorted(_REGISTRY)), st.dictionaries(st.text(), wild))


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_message_error_only(data):
    try:
        msg = decode(data)
    except MessageError:
        return
    assert _holds_declared_types(msg)


@FAST
@given(any_map)
def test_maps_of_wrong_values_raise_message_error_only_and_what_decodes_has_the_declared_types(body):
    try:
        msg = decode(_raw(body))
    except MessageError as exc:
        assert _raw(exc.body) == _raw(body)  # kept (NaN != NaN): what the map names can still be answered
        return
    assert type(msg).__name__ == body["kind"] and _holds_declared_types(msg)
    if isinstance(msg, TokenBatch):
        try:
            assert all(_holds_declared_types(e) for e in msg.unpack())
        except MessageError:
            pass


# ---- valid messages round-trip ------------------------------------------------------------------

token_ids = st.lists(st.integers(0, INT64_MAX), max_size=8)
names = st.text(min_size=1, max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False)
samplings = st.builds(
    SamplingParams, temperature=st.floats(0, 1e6), top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, INT64_MAX), seed=st.none() | st.integers(INT64_MIN, INT64_MAX),
    logprobs=st.none() | st.integers(0, MAX_LOGPROBS), min_tokens=st.integers(0, INT64_MAX))
endpoints = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(0, 99), st.text(max_size=8), st.binary(max_size=8)),
                            max_size=4)
logprob_entries = st.lists(st.none() | st.tuples(finite, st.lists(st.tuples(st.integers(0, 999), finite), max_size=3))
                           .map(lambda e: [e[0], [list(p) for p in e[1]]]), max_size=3)
prompt_logprob_entries = st.lists(st.none() | st.tuples(finite, st.lists(st.tuples(st.integers(0, 999), finite), max_size=3),
                                                        st.integers(1, 999))
                                  .map(lambda e: [e[0], [list(p) for p in e[1]], e[2]]), max_size=3)
valid_messages = st.one_of(
    st.builds(GenerateRequest, request_id=names, prompt_token_ids=token_ids.filter(bool), sampling=samplings,
              max_tokens=st.integers(0, INT64_MAX), stop_token_ids=token_ids, ignore_eos=st.booleans(),
              priority=st.integers(INT64_MIN, INT64_MAX), arrival_time=finite, reply_to=st.text(max_size=8),
              output_token_ids=token_ids),
    st.builds(AbortRequest, request_id=names, reason=st.text(max_size=8)),
    st.builds(PrefillJob, request_id=names, prompt_token_ids=token_ids.filter(bool), sampling=samplings,
              max_tokens=st.integers(0, 99), dst_block_ids=token_ids.filter(bool), kv_endpoint=endpoints,
              decode_worker_id=names, stop_token_ids=token_ids, ignore_eos=st.booleans(), priority=st.integers(-9, 9),
              arrival_time=finite, reply_to=st.text(max_size=8), resume=st.booleans(), handoff_id=st.text(max_size=8)),
    st.builds(PrefillDone, request_id=names, status=st.sampled_from(["ok", "aborted", "failed"]),
              first_token=st.none() | st.integers(0, 999), finish_reason=st.sampled_from([None, "stop", "length"]),
              error=st.none() | st.text(max_size=8), prefill_worker_id=st.text(max_size=8),
              handoff_id=st.text(max_size=8)),
    st.builds(TokenEvent, request_id=names, index=st.integers(0, 999), token_ids=token_ids,
              finish_reason=st.sampled_from([None, "stop", "length", "abort", "error"]),
              error=st.none() | st.text(max_size=8), num_cached_tokens=st.integers(0, 999),
              logprobs=st.none() | logprob_entries, prompt_logprobs=st.none() | prompt_logprob_entries),
    st.builds(WorkerInfo, worker_id=names, role=st.sampled_from(["prefill", "decode"]), model=st.text(max_size=8),
              inbox=st.text(max_size=8), pid=st.integers(0, 2**31), host=st.text(max_size=8), started_at=finite,
              heartbeat_at=finite, num_total_blocks=st.integers(0, 10**6), num_free_blocks=st.integers(0, 10**6),
              block_size=st.integers(1, 256), kv_endpoint=endpoints, device=st.text(max_size=8)),
)


@FAST
@given(valid_messages)
def test_valid_messages_round_trip(msg):
    assert decode(encode(msg)) == msg
    batch = TokenBatch.of([msg]) if isinstance(msg, TokenEvent) else None
    if batch is not None:
        assert decode(encode(batch)).unpack() == [msg]


def test_every_field_of_every_message_has_a_rule_and_its_default_passes_it():
    for cls in _REGISTRY.values():
        assert set(cls.rules) == {f.name for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if default is not dataclasses.MISSING:
                assert cls.rules[f.name].test(default), (cls.__name__, f.name)


# ---- the cases that crashed a worker or the gateway -------------------------------------------------

def _body(msg, **change) -> dict:
    body = msgpack.unpackb(encode(msg), raw=False)
    for name, value in change.items():
        if name.startswith("sampling_"):
            body["sampling"][name[len("sampling_"):]] = value
        else:
            body[name] = value
    return body


REQUEST = GenerateRequest("r1", [1, 2], SamplingParams(), 4, reply_to="tandem:out:gw:g0")
JOB = PrefillJob("r1", [1, 2], SamplingParams(), 4, [0], {"transport": "shm"}, "decode-0")
RECORD = WorkerInfo("d0", "decode", "m", "i", 1, "h", 0.0, 0.0, 64, 64)


@pytest.mark.parametrize("msg, change, reason", [
    (REQUEST, {"max_tokens": "4"}, "max_tokens"),
    (REQUEST, {"max_tokens": None}, "max_tokens"),
    (REQUEST, {"max_tokens": -1}, "max_tokens"),  # 0 is a prompt only scored
    (REQUEST, {"max_tokens": True}, "max_tokens"),  # a bool is no int on the wire
    (REQUEST, {"request_id": ["r1"]}, "request_id"),
    (REQUEST, {"request_id": ""}, "request_id"),
    (REQUEST, {"sampling_temperature": "0.5"}, "temperature"),
    (REQUEST, {"sampling_temperature": float("nan")}, "temperature"),
    (REQUEST, {"sampling_temperature": float("inf")}, "temperature"),
    (REQUEST, {"sampling_top_p": 0.0}, "top_p"),
    (REQUEST, {"sampling_logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    (REQUEST, {"sampling_seed": 2**63}, "seed"),
    (REQUEST, {"sampling": [0.5]}, "sampling"),
    (REQUEST, {"sampling_presence_penalty": 2.5}, "presence_penalty"),
    (REQUEST, {"sampling_frequency_penalty": float("nan")}, "frequency_penalty"),
    (REQUEST, {"sampling_repetition_penalty": 0.0}, "repetition_penalty"),
    (REQUEST, {"sampling_min_p": 1.5}, "min_p"),
    (REQUEST, {"sampling_logit_bias": [[5, 101.0]]}, "logit_bias"),
    (REQUEST, {"sampling_logit_bias": [[-1, 1.0]]}, "logit_bias"),
    (REQUEST, {"sampling_logit_bias": [[5]]}, "logit_bias"),
    (REQUEST, {"sampling_logit_bias": [[5, 1.0]] * 1025}, "logit_bias"),
    (REQUEST, {"sampling_grammar": ""}, "grammar"),
    (REQUEST, {"sampling_grammar": 5}, "grammar"),
    (REQUEST, {"stop_token_ids": None}, "stop_token_ids"),
    (REQUEST, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (REQUEST, {"prompt_token_ids": []}, "prompt_token_ids"),
    (REQUEST, {"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
    (REQUEST, {"output_token_ids": [1.0]}, "output_token_ids"),
    (REQUEST, {"reply_to": 7}, "reply_to"),
    (JOB, {"prompt_token_ids": []}, "prompt_token_ids"),
    (JOB, {"dst_block_ids": [0, -3]}, "dst_block_ids"),
    (JOB, {"kv_endpoint": None}, "kv_endpoint"),
    (JOB, {"decode_worker_id": 3}, "decode_worker_id"),
    (PrefillDone("r1", "ok", 5), {"status": "fine"}, "status"),
    (PrefillDone("r1", "ok", 5), {"first_token": "5"}, "first_token"),
    (TokenEvent("r1", 0, [5]), {"index": -1}, "index"),
    (TokenEvent("r1", 0, [5]), {"logprobs": [[0.5, [["a", 0.1]]]]}, "logprobs"),
    (TokenEvent("r1", 0, [5]), {"prompt_logprobs": [None, [-0.5, [[3, -0.5]]]]}, "prompt_logprobs"),  # no rank
    (TokenEvent("r1", 0, [5]), {"prompt_logprobs": [None, [-0.5, [[3, -0.5]], 0]]}, "prompt_logprobs"),
    (TokenEvent("r1", 0, [5]), {"prompt_logprobs": [[-0.5, [[3, -0.5]], True]]}, "prompt_logprobs"),
    (TokenBatch([]), {"events": [1]}, "events"),
    (RECORD, {"num_total_blocks": "64"}, "num_total_blocks"),
    (RECORD, {"block_size": 0}, "block_size"),
    (RECORD, {"role": "router"}, "role"),
    (REQUEST, {"v": VERSION + 1}, "newer"),
    (REQUEST, {"v": 0}, "version"),
    (REQUEST, {"v": "1"}, "version"),
    (REQUEST, {"v": True}, "version"),
])
def test_a_bad_field_is_refused_with_its_name(msg, change, reason):
    with pytest.raises(MessageError, match=reason):
        decode(_raw(_body(msg, **change)))


def test_required_fields_missing_are_named():
    body = _body(REQUEST)
    del body["max_tokens"], body["sampling"]
    with pytest.raises(MessageError, match="lacks sampling, max_tokens"):
        decode(_raw(body))


def test_unknown_fields_are_still_ignored_and_ints_are_numbers():
    msg = decode(_raw(_body(REQUEST, sampling_temperature=0, sampling_a_later_knob=0.1, a_later_field=[1])))
    assert msg.sampling == SamplingParams(temperature=0.0) and msg.request_id == "r1"


def test_a_registry_record_that_does_not_decode_is_skipped_and_logged_once():
    good = encode(RECORD)
    bad = _raw(_body(dataclasses.replace(RECORD, worker_id="d1"), num_total_blocks="64"))
    prefill = encode(dataclasses.replace(RECORD, worker_id="p0", role="prefill"))  # under a decode key
    names = [keys.worker("decode", w).encode() for w in ("d0", "d1", "p0")] + [b"x", b"y"]
    with capture_logs() as logs:
        for _ in range(3):
            assert parse_records("decode", [good, bad, prefill, None, encode(REQUEST)], names) == [RECORD]
    reported = [entry for entry in logs if entry["event"] == "unreadable registry record skipped"]
    assert sorted(entry["key"] for entry in reported) == ["tandem:worker:decode:d1", "tandem:worker:decode:p0", "y"]
    assert "num_total_blocks" in next(e["error"] for e in reported if e["key"].endswith("d1"))
