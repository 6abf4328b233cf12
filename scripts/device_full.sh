#!/usr/bin/env bash
# One device call (one H200): every GPU test (kernels, engine, cluster), then the engine benchmark
# of all three shapes with the HF prefill and static-cache anchors -> $OUT/benchmarks.json.
#   run with the device tool: bash scripts/device_full.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/gpu tests/engine -m gpu 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
timeout 340 python3 -m tandem.bench.engine --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8,64 \
  --anchors prefill,static --anchor-models llama2-7b --out "$OUT/benchmarks.json" 2>&1 | tee "$OUT/bench.log" | tail -40
