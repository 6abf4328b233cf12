#!/usr/bin/env bash
# Next device session's first two calls (one H200; carry .devrun), back to back:
#   bash scripts/device_next.sh tests   decode attention GPU tests (IDS_AHEAD at 3 stages, the fused
#                                       form at 3 and 4), the engine against HF; the decode tile sweep
#                                       with IDS_AHEAD at whole and partial tiles (~4 min)
#   bash scripts/device_next.sh ab      engine decode A/B: rule / 3 stages / IDS_AHEAD at 3 and 4 stages, at
#                                       batch 1, 8, 64 of three models, alternated twice (~5 min)
# If IDS_AHEAD wins at b64, make it (and its stage count) the rule; then
# `bash scripts/device_final.sh engine` and `... mixed` for the record.
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$1" in
  tests)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
      tests/kernels/test_decode_attention_new_token.py tests/engine/test_engine_gpu.py -m gpu 2>&1 | tail -2
    timeout 240 python3 -m bench.tune_decode_attention --cases 64:256,64:257,64:300,128:416 \
      --models llama2-7b,llama3-8b --tiles --out "$OUT/tune_ids_ahead.json" 2>&1 | grep -E "WRONG|^[^ ]" | tail -12 ;;
  ab)
    timeout 560 python3 scripts/decode_ab.py --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8,64 --rounds 2 \
      --variants rule,s3,ids_ahead_s3,ids_ahead_s4 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  *) echo "usage: $0 tests|ab" >&2; exit 2 ;;
esac
