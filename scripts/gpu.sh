#!/usr/bin/env bash
# GPU runs from a checkout (after `bash scripts/gpu_env.sh bundle` where there is network).
# Each subcommand fits in one 10-minute run; results go under $OUT (default /tmp/out), and a
# short table is printed last.
#
#   bash scripts/gpu.sh check     every Triton kernel against its torch reference at real shapes
#                                 (python3 -m tandem.bench.check_kernels --quick)
#   bash scripts/gpu.sh tests     every GPU test (pytest -m gpu: kernels, engine vs HF, the cluster)
#   bash scripts/gpu.sh engine    tandem bench engine: the three shapes' decode and prefill workloads,
#                                 ceilings and HF anchors -> $OUT/benchmarks.json
#   bash scripts/gpu.sh mixed     the mixed workload through the whole cluster against HF continuous
#                                 batching -> $OUT/mixed/mixed.json
#   bash scripts/gpu.sh two-gpu   (two GPUs) the nccl tests, the handoff against a D2D copy, and the
#                                 mixed workload disaggregated over both GPUs
#   bash scripts/gpu.sh tp        (two GPUs) llama3-8b's decode step split over two ranks (NCCL) against one
#                                 rank's, batches 1, 8 and 64 (tandem.bench.tp_step) -> $OUT/tp_step.json
#   bash scripts/gpu.sh record    engine, then mixed: one record for docs/benchmarks/
#   bash scripts/gpu.sh fp8       the FP8 GPU tests, then llama3-8b's bf16, FP8-weight, FP8-KV and FP8 rows
#   bash scripts/gpu.sh fp8-serve the mixed workload in bf16 and FP8, then 256 streams of 128/128 in FP8
#   bash scripts/gpu.sh fp8-tune  the FP8 weight kernels' GPU tests, then tandem.bench.tune_fp8's GEMV and
#                                 attention sweeps -> $OUT/tune_fp8.json (the rules' data)
#   bash scripts/gpu.sh offline   llama3-8b through tandem serve: 3,072 requests of 128/128 sent at once in
#                                 FP8 and bf16, 256 streams of 128/128 (OFFLINE_RUNS=long: 1,000 of 1000/1000);
#                                 POOLS=separate runs the disaggregated workers instead of the colocated one
#   bash scripts/gpu.sh profile   one step of llama3-8b by kernel kind (GEMMs, attention, the rest) and the
#                                 GEMMs' rate against the matmul rate of the same run: decode batches of
#                                 256 and 1,024 and mixed steps, FP8 (then bf16) -> $OUT/profile_*.json
#   bash scripts/gpu.sh host-tier the host KV tier's GPU test paths and its copies against the link
#                                 (tandem.bench.host_tier, bf16 and FP8 KV) -> $OUT/host_tier_*.json
#   bash scripts/gpu.sh multi-turn the multi-turn workload (tandem bench multi-turn: 44 conversations x 6 turns,
#                                 2,304-token first prompts, 64-token questions and answers, 8 in flight; MT_FLAGS
#                                 replaces these) on llama3-8b FP8 with prefix caching and a device pool of 32,768
#                                 tokens, a quarter of the conversations' final 135k, without and with the host tier
#                                 (MT_TIERS, default "0 24" GB)
#   bash scripts/gpu.sh verify    in one 10-minute call: the GPU tests of the kernels and the engine, then 256
#                                 streams and 3,072 requests at once (offline's c256 and fp8 rows), the kernels
#                                 compiled while serving (none expected: the warm-up covers them) and where a
#                                 second of the decode loop went (loop_seconds); then pack
#   bash scripts/gpu.sh pack      everything under $OUT into one $OUT/results.tar.gz (a run that returns only a few
#                                 files then keeps every log); run it last
#   bash scripts/gpu.sh attention-wide  the FP8 decode attention's tiles at the served shapes (256 and 1,024 rows at
#                                 context 192: 2,048 and 8,192 programs, where no FP8 tile was swept), every form of
#                                 tandem.bench.tune_fp8 --attention-ids, the register-prefetch form and the scores
#                                 from an E4M3 product (FP8_QK)
#                                 -> $OUT/tune_attention_wide.json
#   bash scripts/gpu.sh step-ab   llama3-8b's FP8 decode step at 256 and 1,024 rows by kernel kind and by part, with
#                                 the projections' inputs quantized by passes of their own, by the kernels before them
#                                 (the rule), and with the decode attention's scores from an E4M3 product as well
#                                 (TANDEM_FP8_QK_SCORES=1) -> $OUT/step_*.json
#   bash scripts/gpu.sh lora      the LoRA GPU tests, tandem.bench.lora_step (llama3-8b, batch 64, base / one
#                                 adapter / 8 adapters, rank 16 on all seven projections; LORA_DTYPES, default
#                                 "bf16 bf16-apart fp8": bf16-apart with the A stacks apart from the weights),
#                                 then 256 streams of 128/128 in FP8, base and over 8 adapters
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/mixed"

summary() {  # the lines worth reading, last
  echo "== summary"
  for log in "$@"; do
    [ -f "$log" ] && grep -hE "passed|failed|decode_b|prefill_2048|hf_|ceilings|added_ttft|out_tok_per_s|ttft_ms_p50|tpot_ms_p50" "$log" | cut -c1-200 | tail -25
  done
}

case "${1:-}" in
  check)
    timeout 540 python3 -m tandem.bench.check_kernels --quick --out "$OUT/kernels.json" 2>&1 | tee "$OUT/check.log"
    summary "$OUT/check.log" ;;
  tests)
    timeout 570 python3 -m pytest -q -n 0 -p no:cacheprovider tests/kernels tests/gpu tests/engine -m gpu 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -30
    summary "$OUT/gpu_tests.log" ;;
  engine)
    timeout 330 python3 -m tandem.bench.engine --guided-tokenizer "$BENCH_TOKENIZER" --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8,64 \
      --anchors prefill,static --anchor-models llama2-7b --out "$OUT/benchmarks.json" 2>&1 | tee "$OUT/bench.log"
    summary "$OUT/bench.log" ;;
  mixed)
    timeout 330 python3 -m tandem.bench.cluster_mixed --client-processes 4 --out "$OUT/mixed/mixed.json" 2>&1 \
      | tee "$OUT/mixed/run.log" | tail -12 ;;
  two-gpu)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    timeout 260 python3 -m pytest -q -n 0 -p no:cacheprovider tests/kvtransfer/test_nccl_gpu.py \
      tests/gpu/test_gpu_two_gpus.py tests/gpu/test_gpu_cluster.py -m gpu 2>&1 | tee "$OUT/x2_tests.log" | tail -20
    timeout 180 python3 -m tandem.bench.nccl_handoff --out "$OUT/nccl_handoff.json" 2>&1 | tee "$OUT/nccl_handoff.log" | tail -10
    timeout 200 python3 -m tandem.bench.cluster_mixed --skip-hf --label mixed_128req_2gpu \
      --out "$OUT/mixed/cluster_mixed_2gpu.json" 2>&1 | tee "$OUT/mixed/run_2gpu.log" | tail -3
    summary "$OUT/x2_tests.log" "$OUT/nccl_handoff.log" "$OUT/mixed/run_2gpu.log" ;;
  tp)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    timeout 540 python3 -m tandem.bench.tp_step --checkpoint /tmp/tandem-bench-llama3-8b --model-shape llama3-8b \
      --tp 2 --batches 1,8,64 --out "$OUT/tp_step.json" 2>&1 | tee "$OUT/tp_step.log" | tail -8 ;;
  record)
    timeout 300 python3 -m tandem.bench.engine --guided-tokenizer "$BENCH_TOKENIZER" --models llama3.2-1b,llama2-7b,llama3-8b --batches 1,8,64 \
      --anchors prefill,static --anchor-models llama2-7b --out "$OUT/benchmarks.json" > "$OUT/bench.log" 2>&1
    timeout 270 python3 -m tandem.bench.cluster_mixed --client-processes 4 --out "$OUT/mixed/mixed.json" \
      > "$OUT/mixed/run.log" 2>&1
    summary "$OUT/bench.log" "$OUT/mixed/run.log" ;;
  fp8)
    timeout 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/kernels/test_fp8_weights.py::test_gpu_quantize_rows_fp8_bit_for_bit tests/kernels/test_fp8_tensor_cores.py tests/kernels/test_fp8_kv_cache.py tests/kernels/test_fp8_decode_attention.py \
      tests/engine/test_fp8_engine_gpu.py tests/gpu/test_gpu_fp8_llama3_8b.py tests/gpu/test_gpu_fp8_cluster.py \
      tests/gpu/test_gpu_fp8_kv_transfer.py -m gpu 2>&1 | tee "$OUT/fp8_tests.log" | tail -15
    timeout 300 python3 -m tandem.bench.engine --guided-tokenizer "$BENCH_TOKENIZER" --models llama3-8b --batches 1,64 --anchors '' --quantization fp8 \
      --kv-cache-dtype fp8 --out "$OUT/fp8.json" > "$OUT/fp8_bench.log" 2>&1
    summary "$OUT/fp8_tests.log" "$OUT/fp8_bench.log" ;;
  fp8-serve)
    for variant in bf16 fp8; do
      flags=""; [ $variant = fp8 ] && flags="--quantization fp8 --kv-cache-dtype fp8"
      timeout 170 python3 -m tandem.bench.cluster_mixed --skip-hf --serve-args "$flags" --label "mixed_128req_$variant" \
        --out "$OUT/mixed/mixed_$variant.json" > "$OUT/mixed/run_$variant.log" 2>&1
      tail -3 "$OUT/mixed/run_$variant.log"
    done
    timeout 200 python3 -m tandem.bench.cluster_mixed --skip-hf --model-shape llama3-8b --num-prompts 1024 \
      --input-len-range 128:128 --output-len 128 --max-concurrency 256 --max-batch-size 256 \
      --serve-args "--quantization fp8 --kv-cache-dtype fp8" --label serve_c256_fp8 \
      --out "$OUT/mixed/serve_c256_fp8.json" > "$OUT/mixed/run_c256.log" 2>&1
    tail -3 "$OUT/mixed/run_c256.log" ;;
  fp8-tune)
    timeout 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/kernels/test_fp8_weights.py -m gpu 2>&1 \
      | tee "$OUT/fp8_weight_tests.log" | tail -5
    timeout 420 python3 -m tandem.bench.tune_fp8 --parts gemv,attention --out "$OUT/tune_fp8.json" 2>&1 \
      | tee "$OUT/tune_fp8.log" | grep -E "^(gemv|==|attention)"
    summary "$OUT/fp8_weight_tests.log" ;;
  profile)
    for q in ${PROFILE_DTYPES:-fp8 bf16}; do
      flags=(); [ "$q" = fp8 ] && flags=(--quantization fp8 --kv-cache-dtype fp8)
      timeout "${PROFILE_TIMEOUT:-200}" python3 -m tandem.bench.decode_profile --model llama3-8b --batches 256,1024 \
        --mixed 1024:7168,256:1792 "${flags[@]}" --out "$OUT/profile_$q.json" 2>&1 | tee "$OUT/profile_$q.log" \
        | grep -E "^==|by kind"
    done ;;
  offline)  # TensorRT-LLM's offline shapes and 256 streams, llama3-8b, through tandem serve
    # OFFLINE_RUNS picks among fp8, bf16, c256 and long (1000/1000, 1,000 requests); default the first three
    # OFFLINE_BATCH: --max-batch-size of the offline rows (default 1024); SERVE_EXTRA: more serve
    # flags for every row (e.g. --gateway-processes 8); RUN_TAG: a suffix of the result folders
    ckpt=/tmp/tandem-bench-llama3-8b
    batch=${OFFLINE_BATCH:-1024}
    extra=${SERVE_EXTRA:-}
    for run in ${OFFLINE_RUNS:-fp8 bf16 c256}; do
      case $run in
        fp8) args=(--num-prompts 3072 --input-len-range 128:128 --output-len 128 --max-batch-size "$batch"
                   --serve-args "--quantization fp8 --kv-cache-dtype fp8 $extra" --label offline_128_128_3072) ;;
        bf16) args=(--num-prompts 3072 --input-len-range 128:128 --output-len 128 --max-batch-size "$batch"
                    --serve-args "$extra" --label offline_128_128_3072) ;;
        c256) args=(--num-prompts 1024 --input-len-range 128:128 --output-len 128 --max-concurrency 256
                    --max-batch-size 256 --label serve_c256_128_128
                    --serve-args "--quantization fp8 --kv-cache-dtype fp8 --max-num-tokens ${C256_BUDGET:-2048} $extra") ;;
        long) args=(--num-prompts 1000 --input-len-range 1000:1000 --output-len 1000 --max-batch-size "$batch"
                    --serve-args "--quantization fp8 --kv-cache-dtype fp8 $extra" --label offline_1000_1000_1000) ;;
      esac
      dir="$OUT/$run${RUN_TAG:-}"
      mkdir -p "$dir"
      # each process's CPU share every 2 s (the gateway, the workers, the load clients)
      top -b -d 2 -c -w 180 | grep --line-buffered -E "^top -|tandem|bench|multiprocessing" > "$dir/top.log" &
      sampler=$!
      timeout "${OFFLINE_TIMEOUT:-240}" python3 -m tandem.bench.cluster_mixed --skip-hf --model-shape llama3-8b \
        --checkpoint "$ckpt" --client-processes "${CLIENTS:-4}" "${args[@]}" --pools "${POOLS:-auto}" \
        --out "$dir/result.json" \
        > "$dir/run.log" 2>&1
      status=$?
      kill $sampler 2>/dev/null
      rm -f "$dir/serve_result.json"  # also inside result.json
      echo "== $run${RUN_TAG:-} (exit $status)"
      python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['serve']['metrics']; print({k: m.get(k) for k in ('completed','failed','output_throughput','duration_s','p99_ttft_ms','p99_tpot_ms')})" "$dir/result.json"
    done ;;
  attention-wide)
    timeout 420 python3 -m tandem.bench.tune_fp8 --parts attention --attention-ids --attention-prefetch --attention-fp8-scores \
      --attention-cases "${ATTENTION_CASES:-256:192,1024:192}" --out "$OUT/tune_attention_wide.json" 2>&1 \
      | tee "$OUT/tune_attention_wide.log" | grep -E "^attention|Error"
    ;;
  step-ab)  # llama3-8b's FP8 step by kernel kind and by part at 256 and 1,024 rows: the projections' inputs
            # quantized by their own passes, by the kernels before them (the rule), and with the decode
            # attention's scores from an E4M3 product too (TANDEM_FP8_QK_SCORES=1)
    for variant in quant-apart rule fp8-qk; do
      env=(TANDEM_FUSED_FP8_QUANT=1 TANDEM_FP8_QK_SCORES=0)
      [ $variant = quant-apart ] && env=(TANDEM_FUSED_FP8_QUANT=0 TANDEM_FP8_QK_SCORES=0)
      [ $variant = fp8-qk ] && env=(TANDEM_FUSED_FP8_QUANT=1 TANDEM_FP8_QK_SCORES=1)
      env "${env[@]}" timeout 150 python3 -m tandem.bench.decode_profile --model llama3-8b \
        --batches 256,1024 --quantization fp8 --kv-cache-dtype fp8 --out "$OUT/step_$variant.json" 2>&1 \
        | tee "$OUT/step_$variant.log" | grep -E "^==|by kind|by part" | sed "s/^/$variant: /"
    done ;;
  host-tier)
    for q in bf16 fp8; do
      timeout 120 python3 -m tandem.bench.host_tier --kv-dtype $q --out "$OUT/host_tier_$q.json" 2>&1 \
        | tee "$OUT/host_tier_$q.log" | grep -E "GBps|fraction|equal|Error"
    done ;;
  multi-turn)
    for tier in ${MT_TIERS:-0 24}; do
      mkdir -p "$OUT/multi_turn_$tier"
      timeout "${MT_TIMEOUT:-400}" python3 -m tandem.bench.cluster_mixed --skip-hf --model-shape llama3-8b \
        --checkpoint /tmp/tandem-bench-llama3-8b --max-batch-size 64 --label "multi_turn_64x6_tier$tier" \
        --serve-args "--quantization fp8 --kv-cache-dtype fp8 --enable-prefix-caching --max-tokens-in-paged-kv-cache 32768 --kv-host-cache-gb $tier" \
        --multi-turn "${MT_FLAGS:---num-conversations 44 --num-turns 6 --first-len 2304 --question-len 64 --answer-len 64 --max-concurrency 8}" \
        --out "$OUT/multi_turn_$tier/result.json" > "$OUT/multi_turn_$tier/run.log" 2>&1
      echo "== multi-turn, host tier $tier GB (exit $?)"
      grep -E "bench multi-turn|Error" "$OUT/multi_turn_$tier/run.log" | tail -3
    done ;;
  lora)
    timeout 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/kernels/test_lora.py tests/engine/test_lora_parity.py \
      -m gpu 2>&1 | tee "$OUT/lora_tests.log" | tail -3
    for q in ${LORA_DTYPES:-bf16 bf16-apart fp8}; do  # bf16-apart: the A stacks apart from the weights
      flags=(); [ "$q" = fp8 ] && flags=(--quantization fp8 --kv-cache-dtype fp8)
      [ "$q" = bf16-apart ] && flags=(--fuse off)
      timeout 150 python3 -m tandem.bench.lora_step --model llama3-8b --batch 64 --adapters 8 "${flags[@]}" \
        --out "$OUT/lora_step_$q.json" 2>&1 | tee "$OUT/lora_step_$q.log" | grep -E "^lora_step|Error"
    done
    for n in ${LORA_SERVE:-0 8}; do
      mkdir -p "$OUT/lora_c256_$n"
      timeout 170 python3 -m tandem.bench.cluster_mixed --skip-hf --model-shape llama3-8b \
        --checkpoint /tmp/tandem-bench-llama3-8b --client-processes "${CLIENTS:-8}" --num-prompts 1024 \
        --input-len-range 128:128 --output-len 128 --max-concurrency 256 --max-batch-size 256 \
        --serve-args "--quantization fp8 --kv-cache-dtype fp8 --max-num-tokens 2048" --lora-adapters "$n" \
        --label "serve_c256_128_128_lora$n" --out "$OUT/lora_c256_$n/result.json" > "$OUT/lora_c256_$n/run.log" 2>&1
      echo "== c256 over $n adapters (exit $?)"
      python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['serve']['metrics']; print({k: m.get(k) for k in ('completed','failed','output_throughput')})" "$OUT/lora_c256_$n/result.json"
    done ;;
  verify)
    timeout 170 python3 -m pytest -q -n 0 -p no:cacheprovider tests/kernels tests/engine -m gpu 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -3
    OFFLINE_TIMEOUT=190 OFFLINE_RUNS='c256 fp8' bash "$0" offline
    echo "== kernels compiled while serving"
    grep -h "kernel compiled while serving" "$OUT"/*/cluster.log 2>/dev/null | cut -c1-240 | head -20
    for result in "$OUT"/*/result.json; do
      python3 -c "import json,sys; print(sys.argv[1], json.load(open(sys.argv[1])).get('loop_seconds'))" "$result"
    done
    bash "$0" pack ;;
  pack)
    tar -czf /tmp/results.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tar.gz "$OUT/"
    ls -la "$OUT" ;;
  *) sed -n 2,20p "$0" >&2; exit 2 ;;
esac
