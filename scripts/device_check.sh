#!/usr/bin/env bash
# One device call: GPU kernel tests, GPU engine/transport/cluster tests, then the engine benchmark.
#   run with the device tool: bash scripts/device_check.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/gpu tests/engine -m gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 320 python3 -m bench.engine --out "$OUT/benchmarks.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -45
