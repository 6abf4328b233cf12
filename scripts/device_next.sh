#!/usr/bin/env bash
# Next device session's first two calls (one H200), back to back so the machine stays warm:
#   bash scripts/device_next.sh tests   the decode attention GPU tests (the tuning variants too:
#                                       PARTIAL_FIRST, PREFETCH, PIPELINE; the engine against HF
#                                       with the prefetched fused form), then the tile sweep around
#                                       whole tiles (contexts 256, 257, 300) with every variant, and
#                                       the prefill attention sweep with FOLD_SCALE (~6 min)
#   bash scripts/device_next.sh ab      the engine A/B at batch 1 and 64 of rule / PARTIAL_FIRST /
#                                       32-token tiles / PREFETCH / PIPELINE, alternated twice (~5 min)
# Whatever wins in the engine becomes the rule (and the losers' code goes); then
# `bash scripts/device_final.sh engine` and `... mixed` for the record.   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$1" in
  tests)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
      tests/kernels/test_decode_attention_new_token.py tests/engine/test_engine_gpu.py tests/engine/test_engine_feed.py \
      -m gpu 2>&1 | tail -2
    timeout 200 python3 -m bench.tune_decode_attention --cases 64:256,64:257,64:300 --models llama2-7b --tiles \
      --out "$OUT/tune_variants.json" 2>&1 | grep -v "^ " | tail -4
    python3 - "$OUT/tune_variants.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["model"], r["context"], [(t["config"], round(t["us"], 1)) for t in r["top5"]])
PY
    timeout 200 python3 -m bench.tune_prefill_attention --models llama2-7b,llama3-8b --out "$OUT/tune_prefill.json" \
      2>&1 | grep -v "^  " | tail -3 ;;
  ab)
    timeout 560 python3 scripts/decode_ab.py --models llama3.2-1b,llama2-7b --batches 1,64 --rounds 2 2>&1 \
      | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  *) echo "usage: $0 tests|ab" >&2; exit 2 ;;
esac
