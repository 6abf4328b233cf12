"""The sequence limits the cluster benchmark starts ``tandem serve`` with."""

import dataclasses

from tandem.bench.cluster_mixed import multi_turn_limits, sequence_limits
from tandem.cluster.settings import Settings
from tandem.cluster.settings_rules import check_all

MULTI_TURN = ("--num-conversations 32 --num-turns 6 --first-len 2304 --question-len 64 --answer-len 256 "
              "--max-concurrency 16").split()


def test_fixed_lengths_fit_prompt_and_output():
    assert sequence_limits("1000:1000", 1000) == (1000, 2000)
    assert sequence_limits("128:128", 128) == (768, 1024)  # never below the mixed workload's


def test_multi_turn_limits_hold_the_last_turns_prompt_and_answer():
    max_input_len, max_seq_len = multi_turn_limits(MULTI_TURN)
    last_prompt = 2304 + 5 * (256 + 64)
    assert last_prompt <= max_input_len < max_seq_len and max_seq_len >= last_prompt + 256


def test_tandem_serve_accepts_the_multi_turn_limits():
    """The limits pass tandem serve's own rules (which refuse --max-input-len >= --max-seq-len)."""
    max_input_len, max_seq_len = multi_turn_limits(MULTI_TURN)
    settings = dataclasses.replace(Settings(), max_seq_len=max_seq_len, max_input_len=max_input_len,
                                   max_tokens_in_paged_kv_cache=32768, max_cpu_loras=1)
    check_all(settings, max_positions=8192)
