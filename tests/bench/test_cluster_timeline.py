"""tandem.bench.cluster_timeline reads the stats lines the workers really log (cluster.step_stats
through cluster.process's structlog setup), written here by a process of their own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tandem.bench.cluster_timeline import format_table, parse

_WORKER = textwrap.dedent("""
    import sys, time
    from tandem.cluster.process import configure_logging
    from tandem.cluster.step_stats import StepStats
    configure_logging("info", sys.argv[1])
    stats = StepStats(sys.argv[1], interval_s=0.05)
    print("not json", file=sys.stderr)
    for step in range(3):
        stats.record(num_tokens=8 * (step + 1), forward_s=0.010, loop_s=0.012)
        time.sleep(0.06)
        stats.maybe_log(running=step + 1)
""")


def _log(service: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _WORKER, service], capture_output=True, text=True, check=True)
    return done.stderr.splitlines()


def test_stats_lines_become_rows_in_time_order():
    decode, prefill = _log("decode"), _log("prefill")
    rows = parse(prefill + ["{\"event\": \"request done\", \"timestamp\": \"2026-01-01T00:00:00Z\"}"] + decode)
    assert [r["role"] for r in rows] == ["decode"] * 3 + ["prefill"] * 3  # decode's process ran first
    assert rows[0]["t_s"] == 0.0 and all(a["t_s"] <= b["t_s"] for a, b in zip(rows, rows[1:]))
    first = rows[0]
    assert first["mean_batch"] == 8.0 and first["forward_ms"] == 10.0 and first["loop_ms"] == 12.0
    assert [r["running"] for r in rows[:3]] == [1, 2, 3]
    table = format_table(rows).splitlines()
    assert len(table) == 7 and "running" in table[0] and "mean_batch" in table[0]


def test_a_log_without_stats_gives_no_rows():
    assert parse(["", "plain text", "[1, 2]", "{\"event\": \"serving\"}"]) == []


def test_a_second_of_the_loop_averages_its_parts_over_the_lines_that_stepped():
    from tandem.bench.cluster_timeline import seconds

    rows = [
        {"role": "decode", "steps_per_s": 100.0, "launch_frac": 0.2, "read_frac": 0.6, "device_wait_frac": 0.5,
         "publish_frac": 0.1},
        {"role": "decode", "steps_per_s": 90.0, "launch_frac": 0.4, "read_frac": 0.4, "device_wait_frac": 0.3,
         "publish_frac": 0.1},
        {"role": "decode", "steps_per_s": 0.0, "inbox_frac": 0.99},  # idle: left out
        {"role": "prefill", "steps_per_s": 5.0, "launch_frac": 0.9},
    ]
    assert seconds(rows) == {"launch": 0.3, "publish": 0.1, "read": 0.5, "other": 0.1, "of which device_wait": 0.4}
    assert seconds(rows, "prefill") == {"launch": 0.9, "other": 0.1}
    assert seconds(rows, "gateway") == {}


def test_the_host_tiers_milliseconds_are_shares_of_their_lines_intervals():
    from tandem.bench.cluster_timeline import seconds

    rows = [
        {"role": "decode", "t_s": 0.0, "steps_per_s": 10.0, "intake_frac": 0.5, "tier_issue_ms": 0},
        {"role": "decode", "t_s": 0.25, "steps_per_s": 10.0, "intake_frac": 0.5, "tier_issue_ms": 50,
         "tier_wait_ms": 25},
        {"role": "decode", "t_s": 0.75, "steps_per_s": 10.0, "intake_frac": 0.5, "tier_issue_ms": 50},
    ]
    # 50 ms of 0.25 s and 50 ms of 0.5 s, and 0 in the first line: (0.2 + 0.1 + 0) / 3; 25 ms of 0.25 s / 3
    assert seconds(rows) == {"intake": 0.5, "other": 0.5, "of which tier_issue": 0.1, "of which tier_wait": 0.033}
