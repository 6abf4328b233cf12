"""The field rules of the wire messages (``tandem.cluster.messages``): what each field may hold,
checked when a message is decoded, and ``MessageError``, what a message that breaks one raises.

A rule is a test and its words (``Rule``); the builders here make the common ones (an integer
in a range, a number, text, a list of ids, an optional value) and the nested ones (sampling
settings, logprobs, logit biases) read their maps into the classes the workers hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from tandem.cluster.sampling import BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, PENALTY_RANGE, SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # msgpack and the workers' tensors hold no wider ints


class MessageError(ValueError):
    """A message that cannot be decoded: unknown kind, newer version, bad map, a field's bad
    type or range. ``body``: the message's map when it was one ({} otherwise)."""

    def __init__(self, reason: str, body: dict | None = None):
        super().__init__(reason)
        self.body = body if body is not None else {}


@dataclass(frozen=True)
class Rule:
    """What one field may hold: ``test`` says whether a value does, ``expected`` in words.
    ``read`` turns an accepted wire value into the field's value (a nested map to its class)."""

    test: Callable[[Any], bool]
    expected: str
    read: Callable[[Any, str], Any] = lambda value, _where: value

    def take(self, value: Any, where: str) -> Any:
        if not self.test(value):
            raise MessageError(f"{where} must be {self.expected}, got {describe(value)}")
        return self.read(value, where)


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:40] + '...'}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to us


def _is_float(value: Any) -> bool:
    """Any float, NaN too: a logprob is only shown to the client, and refusing one would drop
    its whole step's batch at the gateway."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(lo: int = 0, hi: int = INT64_MAX) -> Rule:
    return Rule(lambda v: is_int(v) and lo <= v <= hi,
                f"an int >= {lo}" if hi == INT64_MAX else f"an int in [{lo}, {hi}]")


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Rule:
    """A finite float (an int too: 0 and 0.0 are the same temperature); NaN and infinities never,
    they poison the sampler's arithmetic."""

    def test(v):
        if not _is_float(v) or not math.isfinite(v):
            return False
        return (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)

    bounds = [f"{'>' if lo_open else '>='} {lo}"] if lo is not None else []
    bounds += [f"<= {hi}"] if hi is not None else []
    return Rule(test, " ".join(["a finite number", " and ".join(bounds)]).strip())


def text(nonempty: bool = False, choices: tuple[str, ...] | None = None) -> Rule:
    if choices is not None:
        return Rule(lambda v: isinstance(v, str) and v in choices, f"one of {list(choices)}")
    if nonempty:
        return Rule(lambda v: isinstance(v, str) and v != "", "a non-empty string")
    return Rule(lambda v: isinstance(v, str), "a string")


BOOL = Rule(lambda v: isinstance(v, bool), "a bool")


def ids(nonempty: bool = False) -> Rule:
    """Token or block ids: a list of ints >= 0."""
    return Rule(lambda v: isinstance(v, list) and (bool(v) or not nonempty)
                and all(is_int(i) and 0 <= i <= INT64_MAX for i in v),
                "a non-empty list of ints >= 0" if nonempty else "a list of ints >= 0")


def optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.test(v), f"None or {rule.expected}", rule.read)


# a transport's endpoint or any such map: its contents are the transport's to check
STR_MAP = Rule(lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v), "a map with string keys")
BYTE_STRINGS = Rule(lambda v: isinstance(v, list) and all(isinstance(b, bytes) for b in v), "a list of bytes")


TOKEN = integer()


def _is_logprob_entry(entry: Any) -> bool:
    """engine.logprobs' entry: [sampled logprob, [[token id, logprob], ...]] (or None: not asked)."""
    if entry is None:
        return True
    if not (isinstance(entry, list) and len(entry) == 2 and _is_float(entry[0]) and isinstance(entry[1], list)):
        return False
    return all(isinstance(p, list) and len(p) == 2 and TOKEN.test(p[0]) and _is_float(p[1]) for p in entry[1])


LOGPROBS = Rule(lambda v: isinstance(v, list) and all(_is_logprob_entry(e) for e in v),
                "a list of [logprob, [[token id, logprob], ...]] entries")


def _is_prompt_logprob_entry(entry: Any) -> bool:
    """engine.prompt_logprobs' entry: [logprob, [[token id, logprob], ...], rank >= 1] (None: the
    first prompt token, which has none)."""
    if entry is None:
        return True
    return (isinstance(entry, list) and len(entry) == 3 and _is_logprob_entry(entry[:2])
            and is_int(entry[2]) and entry[2] >= 1)


PROMPT_LOGPROBS = Rule(lambda v: isinstance(v, list) and all(_is_prompt_logprob_entry(e) for e in v),
                       "a list of [logprob, [[token id, logprob], ...], rank] entries")
INT64 = integer(INT64_MIN, INT64_MAX)
ID = text(nonempty=True)  # request and worker ids: every table of requests is keyed by them

def _is_bias_entry(entry: Any) -> bool:
    return (isinstance(entry, (list, tuple)) and len(entry) == 2 and TOKEN.test(entry[0])
            and _is_float(entry[1]) and math.isfinite(entry[1]) and -BIAS_RANGE <= entry[1] <= BIAS_RANGE)


# logit_bias: [[token id, bias], ...], read back as the tuple of pairs SamplingParams holds
LOGIT_BIAS = Rule(lambda v: isinstance(v, (list, tuple)) and len(v) <= MAX_LOGIT_BIAS and all(map(_is_bias_entry, v)),
                  f"at most {MAX_LOGIT_BIAS} [token id, bias in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}]] pairs",
                  lambda v, _where: tuple((int(t), float(b)) for t, b in v))

# SamplingParams as the gateway makes them (gateway.protocol, gateway.validation): top_k -1 is
# sent as 0 (off), temperature 0 is greedy
SAMPLING_RULES: dict[str, Rule] = {
    "temperature": number(lo=0.0),
    "top_p": number(lo=0.0, hi=1.0, lo_open=True),
    "top_k": integer(),
    "seed": optional(INT64),
    "logprobs": optional(integer(0, MAX_LOGPROBS)),
    "min_tokens": integer(),
    "presence_penalty": number(lo=-PENALTY_RANGE, hi=PENALTY_RANGE),
    "frequency_penalty": number(lo=-PENALTY_RANGE, hi=PENALTY_RANGE),
    "repetition_penalty": number(lo=0.0, lo_open=True),
    "logit_bias": LOGIT_BIAS,
    "min_p": number(lo=0.0, hi=1.0),
    "grammar": optional(text(nonempty=True)),
    "prompt_logprobs": optional(integer(0, MAX_LOGPROBS)),
}


def _read_sampling(value: dict, where: str) -> SamplingParams:
    """Sampling settings off the wire; fields this version does not know (a newer sender's) are
    dropped, as a message's unknown fields are."""
    return SamplingParams(**{name: rule.take(value[name], f"{where}.{name}")
                             for name, rule in SAMPLING_RULES.items() if name in value})


SAMPLING = Rule(lambda v: isinstance(v, dict), "a sampling map", _read_sampling)
