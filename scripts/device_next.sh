#!/usr/bin/env bash
# Next device session's first call (one H200, ~5 min): the decode attention GPU tests (with the
# partly filled tile first), the tile sweep around whole tiles (contexts 256, 257, 300) with the
# partial tile last and first, then the engine A/B of decode attention variants at batch 64
# (rule / PARTIAL_FIRST / 32-token tiles, alternated twice). Whatever wins in the engine becomes
# the rule; then re-run `bash scripts/device_final.sh engine` and `... mixed` for the record.
#   run with the device tool: bash scripts/device_next.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
  tests/kernels/test_decode_attention_new_token.py -m gpu 2>&1 | tail -2
timeout 120 python3 -m bench.tune_decode_attention --cases 64:256,64:257,64:300 --models llama2-7b,llama3-8b --tiles \
  --out "$OUT/tune_partial.json" 2>&1 | grep -v "^ " | tail -6
timeout 240 python3 scripts/decode_ab.py --models llama2-7b,llama3-8b --batches 64 --rounds 2 2>&1 | tail -6
