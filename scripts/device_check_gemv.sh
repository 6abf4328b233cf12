#!/usr/bin/env bash
# One device call (one H200) for the one-token GEMV kernels: their GPU tests and the engine's
# against HF, the sweep against cuBLAS, then the engine's batch-1 decode with and without them.
#   run with the device tool: bash scripts/device_check_gemv.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py tests/engine/test_engine_gpu.py \
  tests/engine/test_engine_feed.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
timeout 220 python3 -m tandem.bench.tune_gemv --out "$OUT/tune_gemv.json" 2>&1 | tee "$OUT/tune.log" | tail -20
for gemv in 0 1; do
  TANDEM_GEMV=$gemv timeout 130 python3 -m tandem.bench.engine --models llama2-7b,llama3-8b --batches 1 --anchors '' \
    --out "$OUT/engine_gemv$gemv.json" 2>&1 | grep -E "decode_b1 .*ms_per_step" | sed "s/^/gemv=$gemv /"
done
TANDEM_GEMV=1 timeout 60 python3 -m tandem.bench.engine --models llama3.2-1b --batches 1 --anchors '' \
  --out "$OUT/engine_gemv1_1b.json" 2>&1 | grep -E "decode_b1 .*ms_per_step" | sed "s/^/gemv=1 /"
