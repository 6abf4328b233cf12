#!/usr/bin/env bash
# Seventh session's device calls (one H200; carry .devrun):
#   bash scripts/device_next.sh skinny   skinny GEMM GPU tests, the engine against HF, the skinny GEMM
#                                        sweep against cuBLAS (llama2-7b, 64 rows), then the engine
#                                        decode A/B: skinny GEMM up to 64 rows / cuBLAS / skinny up
#                                        to 128, at batch 8, 64, 128 (~6 min; at ea8f9db)
#   bash scripts/device_next.sh ab       engine decode A/B: the rule (skinny GEMM up to 16 rows, long-K
#                                        projections up to 64) / cuBLAS / skinny up to 32 / up to 64,
#                                        batch 1-64, three models (~2 min)
# Then `bash scripts/device_final.sh engine` and `... mixed` for the record.
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$1" in
  skinny)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py tests/kernels/test_gemv.py \
      tests/engine/test_engine_gpu.py -m gpu 2>&1 | tail -3
    timeout 200 python3 -m bench.tune_skinny_gemm --quick --out "$OUT/tune_skinny_gemm.json" 2>&1 \
      | tee "$OUT/tune_skinny_gemm.log" | grep -vE "^\s*$" | tail -14
    timeout 240 python3 scripts/decode_ab.py --models llama2-7b,llama3-8b --batches 8,64,128 --rounds 2 \
      --variants rule,cublas,skinny128 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  ab)
    timeout 300 python3 scripts/decode_ab.py --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8,16,32,64 \
      --rounds 1 --variants rule,cublas,skinny32,skinny64 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  *) echo "usage: $0 skinny|ab" >&2; exit 2 ;;
esac
