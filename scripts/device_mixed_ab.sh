#!/usr/bin/env bash
# One device call (one H200): the batch-1 decode rows without the Triton GEMV (cuBLAS, for the
# A/B against scripts/device_full.sh), then the mixed workload through the whole cluster with the
# HF continuous-batching anchor (4 client processes).
#   run with the device tool: bash scripts/device_mixed_ab.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"/mixed
TANDEM_GEMV=0 timeout 110 python3 -m tandem.bench.engine --models llama2-7b,llama3-8b --batches 1 --anchors '' \
  --out "$OUT/engine_cublas_b1.json" 2>&1 | grep -E "decode_b1 .*ms_per_step" | sed "s/^/cuBLAS /"
timeout 280 python3 -m tandem.bench.cluster_mixed --client-processes 4 --out "$OUT/mixed/mixed.json" 2>&1 | tail -12
