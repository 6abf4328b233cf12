"""Merge a run's rows into the current record, ``docs/benchmarks/current.json``.

    python3 -m tandem.bench.record --machine "one NVIDIA H200, 16 CPU cores" \\
        --command "bash scripts/gpu.sh verify" out/c256/result.json out/fp8/result.json

Each result file is what a benchmark wrote with ``--out`` and holds ``rows`` (the cluster
benchmark's ``{workload, model, dtype, kv_dtype, pools, refused, lora_adapters, metric, value,
anchor, anchor_value, ratio}``; the engine benchmark's ``{workload, model, metric, value, ...}``).
Every row read gets the run's ``machine``, ``commit`` and ``date`` and replaces the current row
of the same workload, model, dtypes, layout, adapters and metric; the run's rows lead the list,
in the order read, and the rows it did not measure keep their place and their own date, commit
and machine. The record's ``date``, ``commit``, ``machine`` and ``command`` become the run's.
A file without rows, or a row without its workload, model, metric or value, stops the merge
before anything is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

DEFAULT_CURRENT = "docs/benchmarks/current.json"
KEY_FIELDS = ("workload", "model", "dtype", "kv_dtype", "pools", "lora_adapters", "metric")
REQUIRED = ("workload", "model", "metric", "value")


class RecordError(ValueError):
    pass


def row_key(row: dict) -> tuple:
    return tuple(row.get(field) for field in KEY_FIELDS)


def read_rows(path: str) -> list[dict]:
    """The rows of one result file (its ``rows``, or the file itself when it is a list of rows)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}: not a readable JSON file ({exc})") from None
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise RecordError(f"{path}: no rows")
    for i, row in enumerate(rows):
        missing = [field for field in REQUIRED if not isinstance(row, dict) or row.get(field) is None]
        if missing:
            raise RecordError(f"{path}: row {i} lacks {', '.join(missing)}")
    return rows


def merge(current: dict, runs: list[dict], machine: str, commit: str, date: str, command: str) -> dict:
    """-> the record with ``runs`` (rows, in order) merged in (module docstring)."""
    fresh, seen = [], set()
    for row in runs:
        row = {**row, "machine": machine, "commit": commit, "date": date}
        key = row_key(row)
        if key in seen:  # measured twice in one run: the later stands
            fresh = [r for r in fresh if row_key(r) != key]
        seen.add(key)
        fresh.append(row)
    kept = [r for r in current.get("rows", []) if row_key(r) not in seen]
    return {**current, "date": date, "commit": commit, "machine": machine,
            "command": f"{command} (its rows first in the list); the others keep their own date, commit and machine",
            "rows": fresh + kept}


def _head_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise RecordError("no --commit given and git cannot name HEAD") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="result files holding rows")
    parser.add_argument("--machine", required=True, help="the machine the rows were measured on")
    parser.add_argument("--command", required=True, help="the command that measured them")
    parser.add_argument("--commit", default=None, help="the commit measured (default: HEAD)")
    parser.add_argument("--date", default=None, help="YYYY-MM-DD (default: today, UTC)")
    parser.add_argument("--current", default=DEFAULT_CURRENT, help="the record to rewrite")
    args = parser.parse_args(argv)
    try:
        runs = [row for path in args.results for row in read_rows(path)]
        with open(args.current) as f:
            current = json.load(f)
        date = args.date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        record = merge(current, runs, args.machine, args.commit or _head_commit(), date, args.command)
    except (RecordError, OSError, json.JSONDecodeError) as exc:
        print(f"tandem.bench.record: {exc}", file=sys.stderr)
        return 2
    with open(args.current, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"{args.current}: {len(runs)} rows merged, {len(record['rows'])} in the record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
