#!/usr/bin/env bash
# Sixth session's exploring call (one H200; carry .devrun), ~6 min. As run (call 3, commit
# 2dc0936) decode_ab's third variant was the register-pipelined loop, removed since (lost):
#   GPU tests of the prefill attention (chunk_kv too), the fused decode form (PREFETCH now the
#   rule) and the engine against HF; the prefill attention sweep with chunk_kv; the engine
#   prefill A/B chunk_kv vs paged; the engine decode A/B rule / no_prefetch / pipeline at b1, b8.
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_attention.py \
  tests/kernels/test_decode_attention_new_token.py tests/engine/test_engine_gpu.py -m gpu 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -3
timeout 200 python3 -m bench.tune_prefill_attention --out "$OUT/tune_prefill.json" 2>&1 | grep -v "^  " | tail -3
timeout 150 python3 scripts/prefill_chunk_ab.py 2>&1 | tee "$OUT/prefill_ab.log" | tail -3
timeout 200 python3 scripts/decode_ab.py --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8 --rounds 2 2>&1 \
  | tee "$OUT/decode_ab.log" | grep "ms/step"
