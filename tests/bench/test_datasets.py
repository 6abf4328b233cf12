"""Tests for the synthetic request sets and arrival times of ``tandem bench serve``
(bench/datasets.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.bench.datasets import arrival_offsets, parse_range, synthetic_requests


def test_synthetic_requests_deterministic_and_in_range():
    a = synthetic_requests(20, chat=False, input_len_range=(5, 9), output_len_range=(2, 4),
                           min_token_id=10, max_token_id=12, seed=3)
    b = synthetic_requests(20, chat=False, input_len_range=(5, 9), output_len_range=(2, 4),
                           min_token_id=10, max_token_id=12, seed=3)
    assert a == b
    assert a != synthetic_requests(20, chat=False, input_len_range=(5, 9),
                                   output_len_range=(2, 4), min_token_id=10,
                                   max_token_id=12, seed=4)
    for s in a:
        assert 5 <= s.prompt_len <= 9 and len(s.prompt) == s.prompt_len
        assert 2 <= s.output_len <= 4
        assert all(isinstance(t, int) and 10 <= t <= 12 for t in s.prompt)
    assert {s.prompt_len for s in a} == set(range(5, 10))  # inclusive bounds
    chat = synthetic_requests(3, chat=True, input_len=12, output_len=7)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 12 for s in chat)
    assert parse_range("3:8") == (3, 8)
    for bad in ("3", "8:3", "0:4", "a:b"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_arrival_offsets():
    assert np.all(arrival_offsets(5, math.inf) == 0)
    off = arrival_offsets(4000, 10.0, 1.0, seed=1)
    assert off[0] == 0 and np.all(np.diff(off) >= 0)
    assert np.mean(np.diff(off)) == pytest.approx(0.1, rel=0.08)
    bursty = np.diff(arrival_offsets(4000, 10.0, 0.25, seed=1))
    assert np.mean(bursty) == pytest.approx(0.1, rel=0.15)
    assert np.std(bursty) > 1.5 * np.std(np.diff(off))  # burstier = more spread
    assert np.array_equal(arrival_offsets(10, 5.0, seed=2), arrival_offsets(10, 5.0, seed=2))
    # the span is (n - 1) / rate whatever the draw or the burstiness (vLLM rescales likewise), so the
    # offered rate is the requested one; infinite burstiness spaces the requests evenly
    for seed in range(5):
        for burstiness in (0.25, 1.0, 4.0):
            assert arrival_offsets(100, 10.0, burstiness, seed)[-1] == pytest.approx(9.9)
    assert np.allclose(arrival_offsets(5, 2.0, math.inf), [0, 0.5, 1.0, 1.5, 2.0])
    assert np.all(arrival_offsets(1, 2.0) == 0)
