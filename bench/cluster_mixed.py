"""The mixed workload through the full cluster on one GPU, against HF continuous batching.

    python -m tandem.bench.cluster_mixed --model-shape llama2-7b --out results.json

Writes a random-weight checkpoint at the shape (safetensors, HF names, bf16)
with a locally built word-level tokenizer covering the whole vocabulary (so every
generated id streams as text and TTFT/ITL are measured per token), measures HF ``generate_batch`` on the same
weights shape, then starts ``tandem serve`` (gateway, prefill and decode
workers on this GPU, cuda_ipc handoff) and drives it with ``tandem.bench.serve``:
128 requests, prompts uniform in [64, 511] tokens (seed 0), 256 new tokens
each, all submitted at once (``--num-prompts``, ``--input-len-range``, ``--output-len`` and
``--max-concurrency`` change the load; ``--serve-args`` the cluster, e.g. its FP8 flags).
``--multi-turn "FLAGS"`` drives it with ``tandem.bench.multi_turn`` (conversations, each turn
the whole conversation so far) instead, its flags as given.
Rows as in ``tandem.bench.engine``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time

import torch

from tandem.bench import cluster_timeline
from tandem.bench import multi_turn as bench_multi_turn
from tandem.bench import throughput as bench_throughput
from tandem.bench.shapes import SHAPES, hf_config_dict
from tandem.import_guard import python_argv
from tandem.placement import colocated, count_gpus


def write_checkpoint(name: str, path: str) -> str:
    from safetensors.torch import save_file

    from tandem.engine.demo_model import make_wordlevel_tokenizer

    os.makedirs(path, exist_ok=True)
    shape = SHAPES[name]
    config = {**hf_config_dict(name), "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    try:  # written by an earlier run of the same shape (the weights are seeded): kept
        with open(os.path.join(path, "config.json")) as f:
            if json.load(f) == config and os.path.isfile(os.path.join(path, "tokenizer.json")):
                return path
    except (OSError, ValueError):
        pass
    if os.path.exists(os.path.join(path, "tokenizer.json")):  # written last: a whole checkout has it
        os.remove(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if not shape.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = rand(vocab, hidden)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    save_file(tensors, os.path.join(path, "model.safetensors"))
    make_wordlevel_tokenizer(vocab).save_pretrained(path)  # every id streams as visible text
    return path


def hf_continuous_batching(name: str) -> float:
    from tandem.bench import hf_anchors

    model, config = hf_anchors.build_hf(name)
    try:
        return hf_anchors.continuous_batching(model, config)["out_tok_per_s"]
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def sequence_limits(input_len_range: str, output_len: int, block: int = 16) -> tuple[int, int]:
    """(--max-input-len, --max-seq-len) that the workload needs: its longest prompt, and that
    plus its output, in whole blocks (at least the 768 / 1024 the mixed workload always ran with)."""
    longest = max(int(x) for x in input_len_range.split(":"))
    max_seq_len = -(-(longest + output_len) // block) * block
    return max(768, longest), max(1024, max_seq_len)


def multi_turn_limits(multi_turn: list[str]) -> tuple[int, int]:
    """(max input length, max sequence length) for ``tandem.bench.multi_turn`` with these flags:
    its last turn's prompt, and that prompt with its answer."""
    flags = _multi_turn_parser().parse_args(multi_turn)
    longest = bench_multi_turn.history_len(flags)
    return sequence_limits(f"1:{longest - flags.answer_len}", flags.answer_len)


def dtypes(serve_args: list[str]) -> tuple[str, str]:
    """(weights, KV cache) as the serve flags choose them."""
    def flag(name, default):
        return serve_args[serve_args.index(name) + 1] if name in serve_args[:-1] else default
    return ("fp8" if flag("--quantization", None) == "fp8" else "bf16",
            "fp8" if flag("--kv-cache-dtype", "auto") == "fp8" else "bf16")


def serve_and_load(model_path: str, out_dir: str, port: int, num_prompts: int, serve_args: list[str],
                   client_processes: int = 1, input_len_range: str = "64:511", output_len: int = 256,
                   max_concurrency: int | None = None, max_batch_size: int = 128, pools: str = "auto",
                   lora_names: list[str] = (), multi_turn: list[str] | None = None) -> dict:
    """Start ``tandem serve``, run the load client against it (``tandem.bench.serve``, or with
    ``multi_turn`` ``tandem.bench.multi_turn`` with those flags) -> the client's result file."""
    max_input_len, max_seq_len = sequence_limits(input_len_range, output_len)
    if multi_turn is not None:
        max_input_len, max_seq_len = multi_turn_limits(multi_turn)
    serve_cmd = [*python_argv("-m", "tandem"), "serve", "--model", model_path, "--port", str(port),
                 "--max-batch-size", str(max_batch_size), "--max-num-tokens", "8192",
                 "--max-seq-len", str(max_seq_len), "--max-input-len", str(max_input_len),
                 "--pools", pools, "--log-level", "info", *serve_args]
    log = open(os.path.join(out_dir, "cluster.log"), "w")
    cluster = subprocess.Popen(serve_cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                               env={**os.environ, "TANDEM_STATS_INTERVAL_S": "0.25"})  # bench.cluster_timeline
    try:
        deadline = time.monotonic() + 420
        for line in cluster.stdout:
            print(line, end="", flush=True)
            if "serving" in line or time.monotonic() > deadline:
                break
        if cluster.poll() is not None:  # it refused its flags or failed to start: say why, run no load
            log.flush()
            with open(log.name) as f:
                raise RuntimeError(f"tandem serve exited ({cluster.returncode}): {f.read()[-2000:]}")
        result_json = os.path.join(out_dir, "serve_result.json")
        load_cmd = [*python_argv("-m", "tandem.bench.serve"), "--base-url", f"http://127.0.0.1:{port}",
                    "--num-prompts", str(num_prompts), "--input-len-range", input_len_range,
                    "--output-len", str(output_len), *(["--max-concurrency", str(max_concurrency)]
                                                       if max_concurrency else []),
                    "--request-rate", "inf", "--seed", "0", "--min-token-id", "3", "--max-token-id", "499",
                    "--result-json", result_json, "--no-progress", "--num-processes", str(client_processes),
                    *(["--lora-modules", *lora_names] if lora_names else [])]
        if multi_turn is not None:
            load_cmd = [*python_argv("-m", "tandem.bench.multi_turn"), "--base-url", f"http://127.0.0.1:{port}",
                        *multi_turn, "--result-json", result_json]
        subprocess.run(load_cmd, check=True, timeout=600)
        with open(result_json) as f:
            return json.load(f)
    finally:
        os.killpg(cluster.pid, signal.SIGTERM)
        try:
            cluster.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(cluster.pid, signal.SIGKILL)


def _multi_turn_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench_multi_turn.add_arguments(parser)
    return parser


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-shape", default="llama2-7b")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--checkpoint", default="/tmp/tandem-bench-ckpt")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--serve-args", default="", help="more `tandem serve` flags, e.g. '--decode-batch-wait-ms 0'")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="tandem.bench.serve --num-processes: one Python client process measured 15%% less "
                             "(6,321 vs 7,431 tok/s, docs/benchmarks.md) than four on 128 streams")
    parser.add_argument("--label", default="mixed_128req", help="workload name in the rows (say, for a two-GPU run)")
    parser.add_argument("--input-len-range", default="64:511", help="prompt lengths, A:B tokens")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    parser.add_argument("--max-batch-size", type=int, default=128, help="tandem serve --max-batch-size")
    parser.add_argument("--pools", default="auto", choices=["auto", "colocated", "separate"],
                        help="tandem serve --pools (auto: one worker for both pools on one GPU)")
    parser.add_argument("--lora-adapters", type=int, default=0,
                        help="serve this many random LoRA adapters (rank --lora-rank, all seven projections) "
                             "and spread the requests over them in turn")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--multi-turn", default=None,
                        help="run tandem.bench.multi_turn with these flags instead of the serve load")
    parser.add_argument("--out", default="cluster_mixed.json")
    args = parser.parse_args()
    name = args.model_shape
    path = write_checkpoint(name, args.checkpoint)
    torch.cuda.empty_cache()
    serve_args, lora_names = args.serve_args.split(), []
    if args.lora_adapters:
        from tandem.bench.random_lora import write_random_adapters
        from tandem.engine.config import ModelConfig

        adapters = write_random_adapters(ModelConfig.from_dict(hf_config_dict(name)),
                                         os.path.join(path, "lora"), args.lora_adapters, args.lora_rank)
        lora_names = list(adapters)
        serve_args += ["--enable-lora", "--max-loras", str(args.lora_adapters), "--max-lora-rank",
                       str(args.lora_rank), "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    result = serve_and_load(path, os.path.dirname(os.path.abspath(args.out)), args.port, args.num_prompts, serve_args,
                            args.client_processes, args.input_len_range, args.output_len, args.max_concurrency,
                            args.max_batch_size, args.pools, lora_names,
                            None if args.multi_turn is None else args.multi_turn.split())
    metrics = result.get("metrics", result)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}, indent=1))
    tok_s = metrics.get("output_throughput")
    dtype, kv_dtype = dtypes(args.serve_args.split())
    pools = "colocated" if colocated(args.pools, count_gpus(), "auto") else "separate"  # what auto chose
    common = dict(workload=args.label, model=name, dtype=dtype, kv_dtype=kv_dtype, pools=pools,
                  refused=bench_throughput.refused(metrics), lora_adapters=args.lora_adapters)
    rows = [dict(common, metric="out_tok_per_s", value=tok_s, anchor=None, anchor_value=None, ratio=None)]
    if metrics.get("cached_fraction_later_turns") is not None:
        rows.append(dict(common, metric="cached_fraction_later_turns", value=metrics["cached_fraction_later_turns"],
                         anchor=None, anchor_value=None, ratio=None))
    for key in ("ttft_ms", "ttft_ms_later_turns", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = metrics.get(key) or {}
        for pct in ("p50", "p99"):
            if pct in stats:
                rows.append(dict(common, metric=f"{key}_{pct}", value=stats[pct],
                                 anchor=None, anchor_value=None, ratio=None))

    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "cluster.log")) as f:
        timeline = cluster_timeline.parse(f)  # where the run's time went, worker by worker
    print(cluster_timeline.format_table(timeline))
    loop_seconds = cluster_timeline.seconds(timeline)
    if loop_seconds:
        print("a second of the decode loop: " + ", ".join(f"{k} {v}" for k, v in loop_seconds.items()))

    def save():
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "serve": result, "timeline": timeline, "loop_seconds": loop_seconds}, f, indent=1)

    save()
    if not args.skip_hf:  # after the cluster, so a late timeout still leaves our numbers
        hf = hf_continuous_batching(name)
        rows[0].update(anchor="hf_continuous_batching", anchor_value=hf, ratio=tok_s / hf if tok_s else None)
        save()
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
