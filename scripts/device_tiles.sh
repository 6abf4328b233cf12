#!/usr/bin/env bash
# Decode attention tiles and fused rotary, one H200 call (~5 min): the tile sweep at the rule's
# splits for the decode workloads' shapes, the engine's batch-1 and batch-64 decode rows with the
# rule's tile, with TANDEM_DECODE_TILE=128,4,4 (best at llama2-7b b64 x 256 in the wide sweep),
# and that tile with TANDEM_FUSED_ROTARY=1; then where a 2048-token llama2-7b prefill spends its time.
#   run with the device tool: bash scripts/device_tiles.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m tandem.bench.tune_decode_attention --cases 64:256,128:416 --models llama2-7b,llama3-8b,llama3.2-1b \
  --tiles --out "$OUT/tune_decode_tiles.json" 2>&1 | tail -6
run_engine() {  # label, then env assignments
  local label=$1; shift
  env "$@" timeout 120 python3 -m tandem.bench.engine --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,64 \
    --anchors '' --out "$OUT/engine_$label.json" 2>&1 | grep -E "^decode_b.*ms_per_step" | sed "s/^/$label /"
}
run_engine rule TANDEM_FUSED_ROTARY=0
run_engine t128 TANDEM_FUSED_ROTARY=0 TANDEM_DECODE_TILE=128,4,4
run_engine t128f TANDEM_FUSED_ROTARY=1 TANDEM_DECODE_TILE=128,4,4
timeout 90 python3 -m tandem.bench.decode_profile --model llama2-7b --batches 1 --prefill 2048 \
  --out "$OUT/prefill_profile.json" 2>&1 | sed -n '/prefill 2048/,$p'
