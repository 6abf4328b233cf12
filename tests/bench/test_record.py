"""tandem.bench.record: a run's rows merged into the current record."""

import json
from pathlib import Path

import pytest

from tandem.bench import record

ROW = dict(workload="serve_c256_128_128", model="llama3-8b", dtype="fp8", kv_dtype="fp8", pools="colocated",
           refused=0, lora_adapters=0, metric="out_tok_per_s", value=1.0, anchor=None, anchor_value=None, ratio=None)


def _write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def _current(tmp_path, rows):
    return _write(tmp_path / "current.json", {"date": "2026-12-01", "commit": "aaaaaaa", "machine": "old",
                                              "command": "old command", "rows": rows})


def test_a_run_replaces_its_rows_and_leads_the_list(tmp_path):
    old_tok = dict(ROW, value=100.0, machine="old", commit="aaaaaaa", date="2026-12-01")
    old_ttft = dict(ROW, metric="ttft_ms_p50", value=170.0, machine="old", commit="aaaaaaa", date="2026-12-01")
    other = dict(ROW, workload="offline_1000_1000_1000", value=9.0, machine="older", commit="bbbbbbb",
                 date="2026-11-30")
    current = _current(tmp_path, [old_tok, other, old_ttft])
    result = _write(tmp_path / "result.json", {"rows": [dict(ROW, value=200.0), dict(ROW, metric="tpot_ms_p99",
                                                                                     value=12.0)],
                                               "serve": {}})
    assert record.main([result, "--current", current, "--machine", "one H200", "--command", "bash scripts/gpu.sh verify",
                        "--commit", "ccccccc", "--date", "2026-12-07"]) == 0
    out = json.loads((tmp_path / "current.json").read_text())
    assert (out["date"], out["commit"], out["machine"]) == ("2026-12-07", "ccccccc", "one H200")
    assert out["command"].startswith("bash scripts/gpu.sh verify")
    assert [(r["metric"], r["value"]) for r in out["rows"]] == [
        ("out_tok_per_s", 200.0), ("tpot_ms_p99", 12.0), ("out_tok_per_s", 9.0), ("ttft_ms_p50", 170.0)]
    assert out["rows"][0]["commit"] == "ccccccc" and out["rows"][2]["commit"] == "bbbbbbb"
    assert out["rows"][3]["machine"] == "old"  # not measured by this run: as it was


def test_rows_that_differ_in_dtype_layout_or_adapters_are_kept_apart(tmp_path):
    current = _current(tmp_path, [dict(ROW, dtype="bf16", kv_dtype="bf16", value=5.0),
                                  dict(ROW, lora_adapters=8, value=6.0), dict(ROW, pools="separate", value=7.0)])
    result = _write(tmp_path / "r.json", {"rows": [dict(ROW, value=8.0)]})
    assert record.main([result, "--current", current, "--machine", "m", "--command", "c", "--commit", "x"]) == 0
    assert [r["value"] for r in json.loads((tmp_path / "current.json").read_text())["rows"]] == [8.0, 5.0, 6.0, 7.0]


@pytest.mark.parametrize("bad", [{"rows": []}, {"serve": {}}, {"rows": [dict(ROW, value=None)]},
                                 {"rows": [{"model": "x", "metric": "m", "value": 1}]}, "not json"])
def test_a_bad_result_changes_nothing(tmp_path, bad, capsys):
    current = _current(tmp_path, [dict(ROW)])
    before = (tmp_path / "current.json").read_text()
    path = tmp_path / "bad.json"
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    good = _write(tmp_path / "good.json", {"rows": [dict(ROW, value=3.0)]})
    assert record.main([good, str(path), "--current", current, "--machine", "m", "--command", "c",
                        "--commit", "x"]) == 2
    assert (tmp_path / "current.json").read_text() == before
    assert "bad.json" in capsys.readouterr().err


def test_a_row_measured_twice_in_one_run_keeps_the_later(tmp_path):
    current = _current(tmp_path, [])
    a = _write(tmp_path / "a.json", {"rows": [dict(ROW, value=1.0)]})
    b = _write(tmp_path / "b.json", {"rows": [dict(ROW, value=2.0)]})
    assert record.main([a, b, "--current", current, "--machine", "m", "--command", "c", "--commit", "x"]) == 0
    assert [r["value"] for r in json.loads((tmp_path / "current.json").read_text())["rows"]] == [2.0]


def test_the_checked_in_record_has_the_fields_the_merge_keys_on():
    with open(Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "current.json") as f:
        current = json.load(f)
    assert {"date", "commit", "machine", "command", "rows"} <= set(current)
    for row in current["rows"]:
        assert all(row.get(field) is not None for field in record.REQUIRED), row
