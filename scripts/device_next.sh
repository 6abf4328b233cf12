#!/usr/bin/env bash
# Next device session's first call (one H200): the GPU tests written after the last call (fed
# steps queued back to back; rotary fused into decode attention), the decode attention sweep at
# batch 64 x context 256 over the wide grid, then the engine's batch-1 and batch-64 decode rows
# with TANDEM_FUSED_ROTARY off and on (it stays off by default until this says it is faster).
#   run with the device tool: bash scripts/device_next.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_feed.py tests/engine/test_engine_gpu.py \
  tests/kernels/test_decode_attention_new_token.py 2>&1 | tail -3
timeout 200 python3 -m bench.tune_decode_attention --cases 64:256 --models llama2-7b,llama3-8b --wide \
  --out "$OUT/tune_decode_wide.json" 2>&1 | tail -4
for fused in 0 1; do
  TANDEM_FUSED_ROTARY=$fused timeout 110 python3 -m bench.engine --models llama3.2-1b,llama2-7b --batches 1,64 \
    --anchors '' --out "$OUT/engine_fused$fused.json" 2>&1 | grep -E "decode_b.*ms_per_step" | sed "s/^/fused=$fused /"
done
