#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issue 5): nccl transport GPU tests, `tandem serve` split over
# two GPUs against HF, and the handoff bandwidth against a plain device-to-device copy.
#   run with the device tool, kind nvidia-h200-x2: bash scripts/device_check_x2.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/kvtransfer/test_nccl_gpu.py tests/gpu/test_gpu_two_gpus.py tests/gpu/test_gpu_cluster.py -m gpu 2>&1 | tee "$OUT/x2_tests.log" | tail -25
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P timeout 180 python3 -m tandem.bench.nccl_handoff --out "$OUT/nccl_handoff.json" 2>&1 | tee "$OUT/nccl_handoff.log" | tail -10
# issue 3 on GPU 0 of the same machine: where a decode step's time goes, then the mixed workload
[ -n "$PROFILE" ] && CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m tandem.bench.decode_profile --out "$OUT/decode_profile.json" 2>&1 | tee "$OUT/decode_profile.log" | grep -v "^  " | tail -4
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m tandem.bench.cluster_mixed $MIXED_ARGS --out "$OUT/cluster_mixed.json" 2>&1 | tee "$OUT/cluster_mixed.log" | tail -3
cp "$OUT/cluster.log" "$OUT/cluster_1gpu.log"; grep -h "decode stats\|prefill stats\|warmed" "$OUT/cluster.log" | head -30 | cut -c1-300
# the same workload disaggregated over both GPUs: prefill on one, decode on the other, nccl handoff
timeout 200 python3 -m tandem.bench.cluster_mixed --skip-hf --label mixed_128req_2gpu --out "$OUT/cluster_mixed_2gpu.json" 2>&1 | tee "$OUT/cluster_mixed_2gpu.log" | tail -3
grep -h "decode stats\|prefill stats" "$OUT/cluster.log" | head -20 | cut -c1-300
echo "== summary"; grep -h "workload" "$OUT"/cluster_mixed*.log | grep "out_tok\|ttft_ms_p50\|itl_ms_p50" | cut -c1-200; grep -h "passed\|failed" "$OUT/x2_tests.log" | tail -2; grep -h "workload" "$OUT/nccl_handoff.log" | cut -c1-220; grep -h " via " "$OUT/nccl_handoff.log" | sort | uniq -c | head -5
