"""`python -m tandem.bench.sampling_controls` runs on the CPU (the tiny model): both variants of
the decode step go through the decode worker's own code and the row has both timings."""

import json

from tandem.bench import sampling_controls


def test_the_overhead_row_runs_on_the_cpu(capsys):
    assert sampling_controls.main(["--device", "cpu", "--batch", "4", "--rounds", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["batch"] == 4
    assert result["plain_ms"] > 0 and result["processed_ms"] > 0
    assert abs(result["ratio"] - result["processed_ms"] / result["plain_ms"]) < 1e-9


def test_every_processed_row_needs_counts_and_carries_a_bias():
    params = sampling_controls.processed_params(128256, 3)
    assert params.penalized and params.greedy and len(params.logit_bias) == 16
    assert all(0 <= t < 128256 for t, _ in params.logit_bias)
