#!/usr/bin/env bash
# One device call (one H200): the mixed workload through the whole cluster, three ways on one
# machine: run-ahead decode with 4 client processes (and the HF continuous-batching anchor),
# the same with 1 client process, and 4 client processes with --decode-run-ahead off.
#   run with the device tool: bash scripts/device_mixed.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"/c4 "$OUT"/c1 "$OUT"/off
timeout 280 python3 -m tandem.bench.cluster_mixed --client-processes 4 --out "$OUT/c4/mixed.json" 2>&1 | tail -4
timeout 150 python3 -m tandem.bench.cluster_mixed --skip-hf --client-processes 1 --label mixed_128req_1client \
  --out "$OUT/c1/mixed.json" 2>&1 | tail -1
timeout 150 python3 -m tandem.bench.cluster_mixed --skip-hf --client-processes 4 --label mixed_128req_run_ahead_off \
  --serve-args "--decode-run-ahead off" --out "$OUT/off/mixed.json" 2>&1 | tail -1
python3 - "$OUT" <<'PY'
import json, sys
for sub in ("c4", "c1", "off"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/{sub}/mixed.json"))["rows"]
    except Exception as exc:
        print(sub, "no result", exc); continue
    print(sub, " ".join(f"{r['metric']}={r['value']:.1f}" + (f" (x{r['ratio']:.2f} of {r['anchor_value']:.0f})" if r.get("ratio") else "") for r in rows))
PY
