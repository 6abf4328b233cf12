#!/usr/bin/env bash
# One device call (one H200): the decode attention kernels' GPU tests, the tile sweep (both kernels
# for MHA shapes), then llama2-7b decode at batch 64 in the engine's CUDA graph with the dot kernel
# and with the sweep's best MHA-kernel tiles.
#   run with the device tool: bash scripts/device_check_mha.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py 2>&1 | tee "$OUT/decode_tests.log" | tail -3
timeout 200 python3 -m bench.tune_decode_attention --out "$OUT/tune_decode.json" 2>&1 | tee "$OUT/tune.log" | tail -8
for tiles in None best None best; do
  timeout 120 python3 - "$tiles" <<'PY' 2>&1 | grep "MHA_TILES\|\"decode_b64\".*ms_per_step" | cut -c1-160
import json, os, runpy, sys
import kernels.decode_attention as d
if sys.argv[1] == "best":
    rows = json.load(open(os.path.join(os.environ["OUT"], "tune_decode.json")))
    row = next(r for r in rows if r["model"] == "llama2-7b" and r["batch"] == 128 and not r["scattered"])
    d.MHA_TILES = tuple(row["best_mha"]["config"][1:5])
print("MHA_TILES", d.MHA_TILES, flush=True)
sys.argv = ["bench.engine", "--models", "llama2-7b", "--batches", "64", "--anchors", "", "--out", "/tmp/e.json"]
runpy.run_module("bench.engine", run_name="__main__")
PY
done
