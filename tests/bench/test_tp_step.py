"""tandem.bench.tp_step on the CPU: the split model's decode step (two gloo ranks) against the
one-rank step, a row each per batch, with their ratio."""

import json

from tandem.bench import tp_step
from tandem.engine.demo_model import make_tiny_checkpoint


def test_rows_for_each_batch_and_degree(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    out = tmp_path / "tp_step.json"
    assert tp_step.main(["--checkpoint", path, "--tp", "2", "--batches", "1,2", "--context", "8", "--steps", "3",
                         "--block-size", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["ratio"] == r["ms"] / rows[i - 1]["ms"] for i, r in enumerate(rows) if r["tp"] == 2)
