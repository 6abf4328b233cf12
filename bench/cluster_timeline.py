"""Where a cluster run's time went, from its workers' periodic stats lines.

Each worker logs one JSON line per TANDEM_STATS_INTERVAL_S (cluster.step_stats): steps and
tokens per second, the mean batch, forward and loop milliseconds, the busy fraction and its
queues. This turns a cluster log into rows ordered by time, seconds from the first line, so
one benchmark run shows the prefill phase, the decode batch growing and the tail.

    python3 -m tandem.bench.cluster_timeline cluster.log

and, last, where an average second of each worker's loop went (``seconds``): its parts'
shares (scheduling, launching steps, reading them back, publishing, admissions), how much
of the reading was the host waiting for the device, and with a host KV tier how much of the
second issuing its copies and waiting for its loads took.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime

COLUMNS = ("tokens_per_s", "steps_per_s", "mean_batch", "forward_ms", "loop_ms", "busy_fraction")


def parse(lines) -> list[dict]:
    """The stats lines of a cluster log (other lines, JSON or not, are skipped), each as
    {t_s, role, service, *COLUMNS, *gauges}, ordered by time; t_s counts from the first."""
    rows = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        event = record.get("event") if isinstance(record, dict) else None
        if not isinstance(event, str) or not event.endswith(" stats") or "timestamp" not in record:
            continue
        row = {k: v for k, v in record.items() if k not in ("event", "level", "timestamp")}
        row["role"] = event[: -len(" stats")]
        row["time"] = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
        rows.append(row)
    rows.sort(key=lambda r: r["time"])
    start = rows[0]["time"] if rows else 0.0
    for row in rows:
        row["t_s"] = round(row.pop("time") - start, 3)
    return rows


def seconds(rows: list[dict], role: str = "decode") -> dict[str, float]:
    """Where an average second of ``role``'s busy lines (those that stepped) went: each loop
    part's share (``cluster.step_stats``: ``<part>_frac``) averaged over them, and the rest of
    the second as ``other``."""
    busy = [r for r in rows if r.get("role") == role and r.get("steps_per_s")]
    if not busy:
        return {}
    parts = sorted({k for r in busy for k in r if k.endswith("_frac") and k != "device_wait_frac"})
    shares = {k[: -len("_frac")]: round(sum(r.get(k, 0.0) for r in busy) / len(busy), 3) for k in parts}
    shares["other"] = round(max(0.0, 1.0 - sum(shares.values())), 3)
    if any("device_wait_frac" in r for r in busy):  # inside "read": the host waiting for the device
        shares["of which device_wait"] = round(sum(r.get("device_wait_frac", 0.0) for r in busy) / len(busy), 3)
    # the host KV tier's milliseconds in each line's interval (engine.host_kv_tier.host_tier_counters),
    # inside "intake" and "launch" (issuing stores and loads; a restore waiting for its load)
    intervals = _intervals([r for r in rows if r.get("role") == role])
    for key in TIER_MS:
        if any(r.get(key) for r in busy):
            share = sum(r.get(key, 0) / 1e3 / intervals[id(r)] for r in busy if intervals.get(id(r)))
            shares[f"of which {key[: -len('_ms')]}"] = round(share / len(busy), 3)
    return shares


TIER_MS = ("tier_issue_ms", "tier_wait_ms")


def _intervals(lines: list[dict]) -> dict[int, float]:
    """Each line's interval in seconds: the time since the line before it (of the same worker
    kind; the first line's is unknown)."""
    out = {}
    for before, line in zip(lines, lines[1:]):
        if "t_s" in line and "t_s" in before and line["t_s"] > before["t_s"]:
            out[id(line)] = line["t_s"] - before["t_s"]
    return out


def format_table(rows: list[dict]) -> str:
    gauges = sorted({k for r in rows for k in r} - {"t_s", "role", "service", *COLUMNS})
    header = ["t_s", "role", *COLUMNS, *gauges]
    lines = [" ".join(f"{h:>13s}" for h in header)]
    for r in rows:
        lines.append(" ".join(f"{str(r.get(h, '')):>13s}" for h in header))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        rows = parse(f)
    print(format_table(rows))
    for role in sorted({r["role"] for r in rows}):
        if shares := seconds(rows, role):
            print(f"a second of {role}'s loop: " + ", ".join(f"{k} {v}" for k, v in shares.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
