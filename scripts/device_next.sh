#!/usr/bin/env bash
# Device calls for the stream-K skinny GEMM (one H200; carry .devrun). The seventh session's earlier
# calls (docs/benchmarks-session7.json) ran this script's `skinny` and `ab` cases at ea8f9db / 6fbcc11.
#   bash scripts/device_next.sh streamk   GPU tests of both skinny GEMMs (real shapes, the race between
#       a row block's contributors, CUDA graph replay, through kernels.ops); engine decode A/B rule /
#       streamk / streamk64 / streamk128 at b8, b32, b64, b128 (llama2-7b, llama3-8b); llama2-7b b64
#       through bench.engine with streamk64's settings, against the floor of that run; the stream-K
#       sweep against cuBLAS (llama2-7b, 64 rows) (~7.5 min at most)
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$1" in
  streamk)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_stream_k.py \
      tests/kernels/test_skinny_gemm.py -m gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 140 python3 scripts/decode_ab.py --models llama2-7b,llama3-8b --batches 8,32,64,128 --rounds 1 \
      --variants rule,streamk,streamk64,streamk128 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step"
    timeout 75 python3 -c "
import argparse, sys
import kernels.ops as ops
from bench.engine import add_arguments, main
ops.SKINNY_STREAM_K, ops.SKINNY_GEMM_MAX_ROWS = True, 64
parser = argparse.ArgumentParser()
add_arguments(parser)
sys.exit(main(parser.parse_args(['--models', 'llama2-7b', '--batches', '64', '--anchors', '',
                                 '--out', '$OUT/engine_streamk64.json'])))
" 2>&1 | grep -E "decode_b64|ceilings"
    timeout 120 python3 -m bench.tune_skinny_gemm --quick --stream-k --out "$OUT/tune_stream_k.json" 2>&1 \
      | tee "$OUT/tune_stream_k.log" | grep -vE "^\s*$" | tail -8 ;;
  *) echo "usage: $0 streamk" >&2; exit 2 ;;
esac
