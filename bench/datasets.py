"""Synthetic request sets for ``tandem bench serve`` (numpy only, no tokenizer).

Completions prompts are lists of random token ids, so the server sees exactly
``input_len`` prompt tokens. Chat prompts are random common English words, one
word per requested input token; a chat template and the tokenizer make the real
count differ a little, which is why the benchmark prefers the server's reported
``usage.prompt_tokens`` when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Short, common words: each is a single token (with its leading space) in the
# usual BPE vocabularies, so the word count is a fair stand-in for token count.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on that with as by at from his her he she it
    they we you are be this which or had not but have one all were when there can
    an their more if out so said what up its about into than them only other new
    some could time these two may then do first any my now such like our over man
    me even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state
    good very make world still own see men work long get here between both life being
    under never day same another know while last might us great old year off come
    since against go came right used take three small large city house water light
    river field stone green blue red black white cold warm early late open close
    round tree road hand head door fire paper horse table music story number point
    plant cloud train ship sound voice"""
    .split()
)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: ``prompt`` is a list of token ids (completions) or a
    string (chat); ``prompt_len`` the nominal prompt tokens; ``output_len`` the
    ``max_tokens`` to ask for (sent with ``ignore_eos``)."""

    index: int
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def parse_range(text: str) -> tuple[int, int]:
    """``"a:b"`` -> ``(a, b)`` with ``1 <= a <= b`` (inclusive bounds)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"expected a range 'a:b', got {text!r}")
    try:
        lo, hi = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"expected integer bounds in 'a:b', got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"range {text!r} must satisfy 1 <= a <= b")
    return lo, hi


def sample_lengths(
    rng: np.random.Generator, n: int, fixed: int, span: tuple[int, int] | None
) -> np.ndarray:
    """``n`` lengths: uniform integers in ``span`` (inclusive) when given, else all ``fixed``."""
    if span is not None:
        lo, hi = span
        return rng.integers(lo, hi + 1, size=n)
    if fixed < 1:
        raise ValueError(f"length must be >= 1, got {fixed}")
    return np.full(n, fixed, dtype=np.int64)


def synthetic_requests(
    num_prompts: int,
    *,
    chat: bool,
    input_len: int = 1024,
    input_len_range: tuple[int, int] | None = None,
    output_len: int = 128,
    output_len_range: tuple[int, int] | None = None,
    min_token_id: int = 10,
    max_token_id: int = 499,
    seed: int = 0,
) -> list[RequestSpec]:
    """Deterministic (for a given ``seed``) random requests."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 0 <= min_token_id <= max_token_id:
        raise ValueError(
            f"need 0 <= min_token_id <= max_token_id, got {min_token_id}..{max_token_id}"
        )
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, input_len_range)
    out_lens = sample_lengths(rng, num_prompts, output_len, output_len_range)
    words = np.asarray(WORDS)
    specs: list[RequestSpec] = []
    for i in range(num_prompts):
        n_in = int(in_lens[i])
        prompt: list[int] | str
        if chat:
            prompt = " ".join(words[rng.integers(0, len(words), size=n_in)].tolist())
        else:
            prompt = rng.integers(min_token_id, max_token_id + 1, size=n_in).tolist()
        specs.append(RequestSpec(i, prompt, n_in, int(out_lens[i])))
    return specs


def arrival_offsets(
    n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send times (seconds after the start) of ``n`` requests.

    Like vLLM: gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the
    mean rate is ``request_rate`` whatever the burstiness (1.0 = Poisson process,
    < 1 burstier, > 1 more even, ``inf`` evenly spaced), and the times are rescaled
    so that the last request goes at (n - 1) / rate: the run offers the requested
    rate whatever the draw. The first request goes at t=0. A rate of ``inf`` sends
    everything at once.
    """
    if n < 1:
        return np.zeros(0)
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if np.isinf(request_rate):
        return np.zeros(n)
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    # A stream apart from the prompts' so that changing the rate keeps the prompts.
    if np.isinf(burstiness):
        return np.arange(n) / request_rate
    rng = np.random.default_rng([seed, 0xA221])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    if n > 1 and times[-1] > 0:
        times *= (n - 1) / request_rate / times[-1]
    return times
