#!/usr/bin/env bash
# Next device session's first call (one H200): the fed-steps GPU test as rewritten after the last
# call, the decode attention sweep at batch 64 x context 256 over the wide grid, then the engine's
# batch-1 and batch-64 decode rows.
#   run with the device tool: bash scripts/device_next.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_feed.py 2>&1 | tail -3
timeout 240 python3 -m bench.tune_decode_attention --cases 64:256 --models llama2-7b,llama3-8b --wide \
  --out "$OUT/tune_decode_wide.json" 2>&1 | tail -4
timeout 200 python3 -m bench.engine --models llama2-7b,llama3-8b --batches 1,64 --anchors '' \
  --out "$OUT/engine.json" 2>&1 | grep -E "decode_b.*ms_per_step"
