#!/usr/bin/env bash
# Next device session's first call (one H200, ~6-7 min): the decode attention GPU tests (partly
# filled tile first; the fused form with its last tile prefetched before the PDL wait; the engine
# against HF with it), the tile sweep around whole tiles (contexts 256, 257, 300) with the partial
# tile last and first, then the engine A/B of the variants at batch 1 and 64 (rule / PARTIAL_FIRST /
# 32-token tiles / PREFETCH, alternated twice). Whatever wins in the engine becomes the rule; then
# `bash scripts/device_final.sh engine` and `... mixed` for the record.
#   run with the device tool: bash scripts/device_next.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
  tests/kernels/test_decode_attention_new_token.py tests/engine/test_engine_gpu.py -m gpu 2>&1 | tail -2
timeout 100 python3 -m bench.tune_decode_attention --cases 64:256,64:257,64:300 --models llama2-7b,llama3-8b --tiles \
  --out "$OUT/tune_partial.json" 2>&1 | grep -v "^ " | tail -6
timeout 300 python3 scripts/decode_ab.py --models llama3.2-1b,llama2-7b --batches 1,64 --rounds 2 2>&1 \
  | tee "$OUT/decode_ab.log" | grep "ms/step"
