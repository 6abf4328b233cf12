#!/usr/bin/env bash
# One device call (one H200) for decode attention work: its GPU tests, the grid-order and tile
# sweep, then the engine's decode rows for the 7B/8B shapes with the HF static-cache anchor.
#   run with the device tool: bash scripts/device_check_decode.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py 2>&1 | tee "$OUT/decode_tests.log" | tail -3
timeout 170 python3 -m tandem.bench.tune_decode_attention --out "$OUT/tune_decode.json" 2>&1 | tee "$OUT/tune.log" | tail -12
timeout 280 python3 -m tandem.bench.engine --models llama2-7b,llama3-8b --batches 1,64 --anchors static --anchor-models llama2-7b \
  --out "$OUT/engine_decode.json" 2>&1 | tee "$OUT/engine.log" | tail -22
