#!/usr/bin/env bash
# The session's record, in device calls (one H200) back to back so the machine stays warm:
#   bash scripts/device_final.sh tests    every GPU test (~6 min: past what fits beside the engine run)
#   bash scripts/device_final.sh engine   the engine benchmark of all three shapes with the HF
#                                         prefill and static-cache anchors -> $OUT/benchmarks.json (~3.5 min)
#   bash scripts/device_final.sh mixed    the mixed workload through the whole cluster with the HF
#                                         continuous-batching anchor, 4 client processes (~5 min)
# (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"/mixed
case "$1" in
  tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/gpu tests/engine -m gpu 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -4 ;;
  engine)
    timeout 300 python3 -m tandem.bench.engine --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8,64 \
      --anchors prefill,static --anchor-models llama2-7b --out "$OUT/benchmarks.json" 2>&1 | tee "$OUT/bench.log" \
      | grep -E "decode_b|prefill_2048|hf_|ceilings|added_ttft" ;;
  mixed)
    timeout 330 python3 -m tandem.bench.cluster_mixed --client-processes 4 --out "$OUT/mixed/mixed.json" 2>&1 | tail -12 ;;
  *) echo "usage: $0 tests|engine|mixed" >&2; exit 2 ;;
esac
