#!/usr/bin/env bash
# A start for the next device session (one H200; carry .devrun): the decode-batch projections'
# GPU tests, then the engine decode A/B of the skinny GEMM rule against cuBLAS (~2.5 min).
#   bash scripts/device_next.sh check
# The seventh session's calls ran this script's earlier cases (docs/benchmarks-session7.json):
# `tests`/`ab` at 1b9d36e (IDS_AHEAD), `skinny` at ea8f9db, `ab` at 6fbcc11, `streamk` at 5c97901.
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$1" in
  check)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py tests/kernels/test_gemv.py \
      -m gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 150 python3 scripts/decode_ab.py --models llama2-7b,llama3-8b --batches 8,32,64 --rounds 1 \
      --variants rule,cublas 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  ab8)  # eighth session: the add-norm finish and the L2 prefetch (~7 min)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_add_norm.py \
      tests/kernels/test_skinny_gemm.py tests/engine/test_engine_gpu.py tests/gpu/test_gpu_llama3_8b_parity.py \
      -m gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 330 python3 scripts/decode_ab.py --models llama2-7b,llama3-8b --batches 8,64 --rounds 1 \
      --variants rule,unfused,l2,fused32,all64_l2 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  ab8c)  # eighth session, call 3: staggered decode tiles (~5 min)
    timeout 330 python3 scripts/decode_ab.py --models llama2-7b --batches 8,64 --rounds 2 \
      --variants rule,stagger,stagger_rev 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_attention.py \
      tests/kernels/test_decode_attention_new_token.py -m gpu -k "real_shapes or graph" 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8 ;;
  *) echo "usage: $0 check|ab8|ab8c" >&2; exit 2 ;;
esac
