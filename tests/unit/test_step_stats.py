"""Worker-loop statistics: rates over the interval, then reset."""

import structlog

from tandem.cluster.step_stats import StepStats


def test_logs_rates_once_per_interval_and_resets(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("tandem.cluster.step_stats.time.monotonic", lambda: clock[0])
    stats = StepStats("decode", interval_s=5.0)
    for batch in (4, 8, 12):
        stats.record(batch, forward_s=0.010, loop_s=0.012)
    clock[0] += 2.0
    assert not stats.maybe_log(running=3)
    clock[0] += 3.0
    with structlog.testing.capture_logs() as logs:
        assert stats.maybe_log(running=3, waiting=1)
    (entry,) = logs
    assert entry["event"] == "decode stats"
    assert entry["tokens_per_s"] == 24 / 5.0 and entry["mean_batch"] == 8.0
    assert entry["forward_ms"] == 10.0 and entry["loop_ms"] == 12.0 and entry["running"] == 3
    assert stats.steps == 0 and stats.tokens == 0
    clock[0] += 6.0
    with structlog.testing.capture_logs() as logs:
        stats.maybe_log()
    assert logs == []  # nothing ran: nothing to report


def test_a_line_carries_how_much_each_counter_rose_in_its_interval(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("tandem.cluster.step_stats.time.monotonic", lambda: clock[0])
    counts = {"cuda_mallocs": 7, "alloc_retries": 0}
    stats = StepStats("decode", interval_s=1.0, counters=lambda: dict(counts))  # read at start: the baseline
    stats.record(8, forward_s=0.01, loop_s=0.01)
    counts.update(cuda_mallocs=10, alloc_retries=1)
    clock[0] += 1.0
    with structlog.testing.capture_logs() as logs:
        assert stats.maybe_log()
    assert (logs[0]["cuda_mallocs"], logs[0]["alloc_retries"]) == (3, 1)
    stats.record(8, forward_s=0.01, loop_s=0.01)
    clock[0] += 1.0
    with structlog.testing.capture_logs() as logs:
        assert stats.maybe_log()
    assert (logs[0]["cuda_mallocs"], logs[0]["alloc_retries"]) == (0, 0)  # nothing new since the last line


def test_the_allocator_has_no_counters_off_the_gpu():
    import torch

    from tandem.engine.allocator_counters import allocator_counters

    assert allocator_counters(torch.device("cpu")) == {}


def test_a_line_carries_each_part_of_the_loops_share_of_its_seconds(monkeypatch):
    """``phase`` times a part of the loop turn (also when it raises), ``add_time`` adds time
    measured elsewhere; a line carries each part's share of the interval, then they start over."""
    clock, wall = [100.0], [10.0]
    monkeypatch.setattr("tandem.cluster.step_stats.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("tandem.cluster.step_stats.time.perf_counter", lambda: wall[0])
    stats = StepStats("decode", interval_s=1.0)
    for _ in range(4):
        with stats.phase("schedule"):
            wall[0] += 0.05
        with stats.phase("launch"):
            wall[0] += 0.025
        stats.add_time("device_wait", 0.1)
        stats.record(8, forward_s=0.2, loop_s=0.2)
    try:
        with stats.phase("intake"):
            wall[0] += 0.1
            raise RuntimeError("a bad message")
    except RuntimeError:
        pass
    clock[0] += 2.0
    with structlog.testing.capture_logs() as logs:
        assert stats.maybe_log()
    (entry,) = logs
    assert (entry["schedule_frac"], entry["launch_frac"], entry["device_wait_frac"], entry["intake_frac"]) == (
        0.1, 0.05, 0.2, 0.05)
    stats.record(8, forward_s=0.2, loop_s=0.2)
    clock[0] += 1.0
    with structlog.testing.capture_logs() as logs:
        assert stats.maybe_log()
    assert not any(key.endswith("_frac") for key in logs[0])  # no part timed in this interval
