#!/usr/bin/env bash
# A short check of the decode attention after a change (one H200; carry .devrun), ~3 min: its GPU
# tests (plain and fused forms, PREFETCH at every batch and by default) and the engine against HF,
# then the engine decode A/B (scripts/decode_ab.py: rule / no_prefetch / prefetch_b8) on llama3.2-1b
# at batch 1 and 8, one round.
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
  tests/kernels/test_decode_attention_new_token.py tests/engine/test_engine_gpu.py -m gpu 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -2
timeout 75 python3 scripts/decode_ab.py --models llama3.2-1b --batches 1,8 --rounds 1 \
  --variants rule,no_prefetch,prefetch_b8 2>&1 \
  | tee "$OUT/decode_ab.log" | grep "ms/step"
