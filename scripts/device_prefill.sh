#!/usr/bin/env bash
# Prefill attention tiles, one H200 call (~4 min): the prefill attention GPU tests (both grid orders),
# then the tile sweep against torch SDPA at 2048 tokens on the three model shapes.
#   run with the device tool: bash scripts/device_prefill.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_attention.py -k gpu 2>&1 | tail -2
timeout 400 python3 -m tandem.bench.tune_prefill_attention --out "$OUT/tune_prefill.json" 2>&1 | grep -v "^  " | tail -5
python3 - "$OUT/tune_prefill.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["model"], "top5:", [(t["config"], round(t["ms"], 3)) for t in r["top5"]])
PY
