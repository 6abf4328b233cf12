#!/usr/bin/env bash
# A start for the next device session (one H200; carry .devrun): the decode-batch projections'
# GPU tests, then the engine decode A/B of the skinny GEMM rule against cuBLAS (~2.5 min).
#   bash scripts/device_next.sh check
# The seventh session's calls ran this script's earlier cases (docs/benchmarks-session7.json):
# `tests`/`ab` at 1b9d36e (IDS_AHEAD), `skinny` at ea8f9db, `ab` at 6fbcc11, `streamk` at 5c97901;
# the eighth session's `ab8` at a82129f, `ab8b` at f113132, `ab8c` at 521a206 and 9713b49.
# The tenth session ran `ab9` at ecd6a75 and `ab9b` at 515d985 (docs/benchmarks-session10.json).
set -o pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "$1" in
  check)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py tests/kernels/test_gemv.py \
      -m gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 150 python3 scripts/decode_ab.py --models llama2-7b,llama3-8b --batches 8,32,64 --rounds 1 \
      --variants rule,cublas 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  ab9)  # tenth session (planned in the ninth): registers/shared memory, gate/up + SiLU·mul skinny at 64 rows, decode attention's
        # registers capped, a mixed run's timeline (~8 min)
    python3 scripts/kernel_resources.py 2>&1 | tee "$OUT/resources.log" | grep -E "regs|Error"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py tests/kernels/test_gemv.py \
      -m gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 200 python3 scripts/decode_ab.py --models llama2-7b --batches 64 --rounds 2 \
      --variants rule,gate_up64_w,gate_up64_n 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step"
    timeout 200 python3 scripts/decode_ab.py --models llama2-7b --batches 64,128 --rounds 2 \
      --variants rule,reg96,reg80 2>&1 | tee "$OUT/decode_ab_reg.log" | grep "ms/step"
    mkdir -p "$OUT/mixed"
    timeout 200 python3 -m tandem.bench.cluster_mixed --skip-hf --out "$OUT/mixed/cluster_mixed.json" > "$OUT/mixed/run.log" 2>&1
    grep -E "out_tok_per_s|ttft_ms_p50|ttft_ms_p99" "$OUT/mixed/run.log" ;;
  ab9b)  # tenth session, second call: gate/up at 64 rows on its tile (the rule now), the handoff
         # kernels warmed up; GPU tests of both, one A/B round, a mixed run's timeline (~3 min)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_skinny_gemm.py tests/kernels/test_gemv.py \
      tests/kernels/test_block_copy.py -m gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 120 python3 scripts/decode_ab.py --models llama2-7b --batches 64 --rounds 1 \
      --variants rule 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step"
    mkdir -p "$OUT/mixed"
    timeout 200 python3 -m tandem.bench.cluster_mixed --skip-hf --out "$OUT/mixed/cluster_mixed.json" > "$OUT/mixed/run.log" 2>&1
    grep -E "out_tok_per_s|ttft_ms_p50|ttft_ms_p99" "$OUT/mixed/run.log"
    grep "warmed up" "$OUT/mixed/cluster.log"
    python3 -m tandem.bench.cluster_timeline "$OUT/mixed/cluster.log" | head -8 | cut -c1-120 ;;
  ab11)  # eleventh session: decode attention's block ids in registers (IDS_IN_REGISTERS) with the tiles
         # a local sm90 compile pipelines; resources, GPU tests, one engine A/B round at b64/b128 (~7 min)
    python3 scripts/kernel_resources.py 2>&1 | tee "$OUT/resources.log" | grep -E "decode|Error"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
      tests/kernels/test_decode_attention_new_token.py -m gpu 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 330 python3 scripts/decode_ab.py --models llama2-7b --batches 64,128 --rounds 1 \
      --variants rule,ids,ids64s3,ids32s3,ids32s4,ids16s4,ids32s3w2 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  ab11b)  # eleventh session, second call: the GPU tests on the 2-warp tile, then two A/B rounds of the
          # best of ab11 with and without rotary fused at b1/b8/b64/b128 (~5 min)
    TANDEM_DECODE_TILE=32,2,3 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
      tests/kernels/test_decode_attention_new_token.py -m gpu -k True 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 400 python3 scripts/decode_ab.py --models llama2-7b --batches 1,8,64,128 --rounds 2 \
      --variants rule,ids32s3,ids32s3w2,ids32s4w2,ids32s3_f,ids32s3w2_f 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  ab11c)  # eleventh session, third call: the wide-grid rule against the old one on llama3-8b and llama3.2-1b
          # (it applies from 1024 programs: 8B b128; 1B is head_dim 64, unchanged) and llama2-7b b64/b128 (~3 min)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py -m gpu \
      2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FAILED|passed|failed|Error" | tail -8
    timeout 400 python3 scripts/decode_ab.py --models llama2-7b,llama3-8b --batches 64,128 --rounds 2 \
      --variants rule,old 2>&1 | tee "$OUT/decode_ab.log" | grep "ms/step" ;;
  *) echo "usage: $0 check|ab9|ab9b|ab11|ab11b|ab11c" >&2; exit 2 ;;
esac
