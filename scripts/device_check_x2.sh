#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issue 5): nccl transport GPU tests, `tandem serve` split over
# two GPUs against HF, and the handoff bandwidth against a plain device-to-device copy.
#   run with the device tool, kind nvidia-h200-x2: bash scripts/device_check_x2.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kvtransfer/test_nccl_gpu.py tests/gpu/test_gpu_two_gpus.py -m gpu 2>&1 | tee "$OUT/x2_tests.log" | tail -25
timeout 240 python3 -m bench.nccl_handoff --out "$OUT/nccl_handoff.json" 2>&1 | tee "$OUT/nccl_handoff.log" | tail -10
