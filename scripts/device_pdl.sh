#!/usr/bin/env bash
# One device call (one H200): batch-1 decode with and without programmatic dependent launch
# (kernels.pdl), every GPU test, then the engine benchmark of all three shapes with the HF
# prefill and static-cache anchors -> $OUT/benchmarks.json (PDL off there if it failed above).
#   run with the device tool: bash scripts/device_pdl.sh   (carry: .devrun)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for pdl in 1 0; do
  TANDEM_PDL=$pdl timeout 80 python3 -m tandem.bench.engine --models llama2-7b --batches 1 --anchors '' \
    --out "$OUT/engine_pdl$pdl.json" > "$OUT/engine_pdl$pdl.log" 2>&1
  grep -E "decode_b1 .*ms_per_step" "$OUT/engine_pdl$pdl.log" | sed "s/^/pdl=$pdl /" || tail -5 "$OUT/engine_pdl$pdl.log"
done
grep -q decode_b1 "$OUT/engine_pdl1.log" || { export TANDEM_PDL=0; echo "PDL failed: off for the rest"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/gpu tests/engine -m gpu 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
timeout 200 python3 -m tandem.bench.engine --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8,64 \
  --anchors prefill,static --anchor-models llama2-7b --out "$OUT/benchmarks.json" 2>&1 | tee "$OUT/bench.log" \
  | grep -E "decode_b|prefill_2048.*fraction|hf_|ceilings|added_ttft"
