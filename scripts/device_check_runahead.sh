#!/usr/bin/env bash
# One device call (one H200) for the run-ahead decode loop: its GPU tests (fed graph steps, the
# engine against HF, the whole cluster against HF generate), then the engine rows of all three
# shapes with the HF prefill and static-cache anchors.
#   run with the device tool: bash scripts/device_check_runahead.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_feed.py tests/engine/test_engine_gpu.py \
  tests/gpu/test_gpu_cluster.py tests/gpu/test_gpu_cuda_ipc.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
timeout 390 python3 -m tandem.bench.engine --models ${MODELS:-llama3.2-1b,llama2-7b,llama3-8b} --batches 1,8,64 \
  --anchors prefill,static --anchor-models llama2-7b --out "$OUT/benchmarks.json" 2>&1 | tee "$OUT/bench.log" | tail -45
