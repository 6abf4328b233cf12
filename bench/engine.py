"""`tandem bench engine`: our engine against the hardware and HF, in one process.

    python -m tandem.bench.engine --out results.json [--models llama3.2-1b,llama2-7b,llama3-8b]
                           [--anchors static,eager,prefill,cb] [--anchor-models llama2-7b]

Measures the ceilings (HBM copy, bf16 matmul), then for each model shape with
random bf16 weights: decode at batch 1, 8, 64 (prompt 128, 256 new tokens,
CUDA graphs, greedy sampling; each step launched before the previous one's
tokens are read, as the decode worker runs it), the largest of those batches
again with logit_bias and the penalties on every row against the same steps
without (``tandem.bench.sampling_controls``), prefill of one
2048-token prompt, and the KV handoff of that prompt (the cuda_ipc copy path);
then the HF transformers anchors. With ``--quantization fp8`` each model runs again with FP8
weights (its projections quantized per output channel, as ``--quantization fp8`` serves them):
rows suffixed ``_fp8`` beside the bf16 ones, decode at the same batches against a bandwidth
floor of the bytes an FP8 step reads (E4M3 weights, their scales, the bf16 embeddings, lm_head
and norms, the KV) and against the bf16 step, and the 2048-token prefill against the FP8
matmul rate. With ``--kv-cache-dtype fp8`` each model runs again with an FP8 KV cache (bf16
weights): rows suffixed ``_fp8kv``, decode at the same batches against the floor of the bytes
such a step reads (the KV in one byte an element) and against the bf16-cache step, the prefill
and the KV handoff (half the bytes), and a long-context decode (batch 8 at 2048 + 64 tokens),
where the KV read weighs most, with both caches on the same weights. Writes JSON rows
{workload, model, metric, value, anchor, anchor_value, ratio} and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback

import torch

from tandem.bench.engine_args import add_arguments
from tandem.bench.shapes import hf_config_dict

ROWS: list[dict] = []


def row(workload, model, metric, value, anchor=None, anchor_value=None, ratio=None):
    r = dict(workload=workload, model=model, metric=metric, value=value, anchor=anchor,
             anchor_value=anchor_value, ratio=ratio)
    ROWS.append(r)
    print(json.dumps(r), flush=True)


def build_runner(name: str, num_tokens: int, max_seq_len: int, block_size: int = 16, max_batch_size: int = 64,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
    from tandem.engine.config import ModelConfig
    from tandem.engine.loader import random_model
    from tandem.engine.runner import ModelRunner

    config = ModelConfig.from_dict(hf_config_dict(name))
    model = random_model(config, torch.bfloat16, "cuda", quantization=quantization)
    runner = ModelRunner.from_model(model, config, num_blocks=-(-num_tokens // block_size), block_size=block_size,
                                    kv_cache_dtype=kv_cache_dtype)
    runner.enable_cuda_graphs(max_batch_size, max_seq_len)
    return runner


def weight_bytes(runner) -> int:
    """Every weight's bytes (FP8 weights: their E4M3 rows and fp32 row scales)."""
    scales = [b for name, b in runner.model.named_buffers() if name.endswith("weight_scale")]
    return sum(t.numel() * t.element_size() for t in [*runner.model.parameters(), *scales])


def decode_workload(runner, allocator, batch: int, prompt_len: int = 128, new_tokens: int = 256) -> dict:
    """Greedy decode as the decode worker runs it: each step launched before the previous
    step's tokens are read on the host, its input tokens fed from them on the device."""
    from tandem.cluster.sampling import SamplingParams
    from tandem.engine.attention import SeqChunk
    from tandem.engine.sampler import sample_async
    from tandem.engine.step_tokens import StepTokens, TokenFeed

    vocab = runner.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    blocks = [allocator.allocate(prompt_len + new_tokens) for _ in range(batch)]
    greedy = [SamplingParams(temperature=0.0)] * batch
    rows = list(range(batch))
    try:
        logits = runner.forward([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])
        previous = StepTokens(sample_async(logits, greedy, [0] * batch))
        positions = [prompt_len] * batch  # where each sequence's next input token goes
        warmup = 8
        for step in range(new_tokens - 1):
            if step == warmup:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            chunks = [SeqChunk([0], n, b) for n, b in zip(positions, blocks)]
            logits = runner.forward(chunks, TokenFeed(previous.device_tokens, rows))
            current = StepTokens(sample_async(logits, greedy, [step + 1] * batch))
            previous.wait()  # the host reads step s-1's tokens while the device runs step s
            previous = current
            positions = [n + 1 for n in positions]
        previous.wait()
        ms = (time.perf_counter() - t0) / (new_tokens - 1 - warmup) * 1e3
    finally:
        for b in blocks:
            allocator.free(b)
    avg_ctx = prompt_len + new_tokens / 2
    kv_read = batch * avg_ctx * runner.config.kv_bytes_per_token(runner.kv_pool.dtype)
    return {"ms_per_step": ms, "out_tok_per_s": batch * 1e3 / ms, "kv_read_bytes": kv_read}


def prefill_workload(runner, allocator, prompt_len: int = 2048) -> dict:
    from tandem.bench.timing import median_ms
    from tandem.engine.attention import SeqChunk

    prompt = torch.randint(3, runner.config.vocab_size, (prompt_len,)).tolist()
    blocks = allocator.allocate(prompt_len)
    try:
        ms = median_ms(lambda: runner.forward([SeqChunk(prompt, 0, blocks)]), reps=5, warmup=2)
    finally:
        allocator.free(blocks)
    c = runner.config
    params = sum(p.numel() for p in runner.model.parameters())
    body = params - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    flops = 2 * body * prompt_len + 2 * prompt_len**2 * c.num_q_heads * c.head_dim * c.num_layers
    return {"ms": ms, "flops": flops}


def handoff_workload(runner, allocator, prompt_len: int = 2048) -> dict:
    """Copy a prompt's blocks into another pool through the cuda_ipc connection's copy path."""
    from tandem.bench.timing import median_ms
    from tandem.kvtransfer.cuda_ipc import CudaIpcConnection

    num_blocks = -(-prompt_len // runner.block_size)
    src = allocator.allocate(prompt_len)
    dst_kv = torch.empty_like(runner.kv_pool.kv[:, :, : num_blocks + 8])
    dst = list(range(4, 4 + num_blocks))
    conn = CudaIpcConnection(dst_kv)

    def copy():
        transfer = conn.write(runner.kv_pool.kv, src, dst)
        while not transfer.done():
            pass

    try:
        ms = median_ms(copy, reps=10, warmup=2)
        assert torch.equal(dst_kv[:, :, dst].view(torch.uint8), runner.kv_pool.kv[:, :, src].view(torch.uint8))
    finally:
        allocator.free(src)
    nbytes = num_blocks * runner.kv_pool.bytes_per_block
    return {"ms": ms, "bytes": nbytes, "GBps": nbytes / (ms / 1e3) / 1e9}


def run_model(name: str, ceil: dict, batches: list[int], guided_tokenizer: str | None = None) -> None:
    from tandem.bench import guided_decode, sampling_controls
    from tandem.engine.block_allocator import BlockAllocator

    max_batch = max(batches)
    runner = build_runner(name, num_tokens=max_batch * 400 + 2 * 2048 + 1024, max_seq_len=4096,
                          max_batch_size=max_batch)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    _weights_and_decode(runner, allocator, name, ceil, batches)
    # what logit_bias and the penalties on every row add to a decode step (tandem.bench.sampling_controls)
    c = sampling_controls.overhead(runner, allocator, batch=max_batch)
    row(f"decode_b{max_batch}_penalties", name, "ms_per_step", c["processed_ms"], "plain_ms_per_step",
        c["plain_ms"], c["ratio"])
    # what structured outputs on half the rows add to a decode step (tandem.bench.guided_decode)
    if guided_tokenizer is not None:
        g = guided_decode.overhead(runner, allocator, guided_tokenizer, batch=max_batch)
        row(f"decode_b{max_batch}_guided_half", name, "ms_per_step", g["guided_ms"], "plain_ms_per_step",
            g["plain_ms"], g["ratio"])
    p = prefill_workload(runner, allocator)
    row("prefill_2048", name, "ms", p["ms"], "matmul_floor_ms", p["flops"] / (ceil["bf16_matmul_TFLOPs"] * 1e12) * 1e3,
        None)
    mfu = p["flops"] / (p["ms"] / 1e3) / (ceil["bf16_matmul_TFLOPs"] * 1e12)
    row("prefill_2048", name, "fraction_of_matmul_rate", mfu)
    h = handoff_workload(runner, allocator)
    row("kv_handoff_2048", name, "GBps", h["GBps"], "hbm_copy_GBps", ceil["hbm_copy_TBps"] * 1e3,
        h["GBps"] / (ceil["hbm_copy_TBps"] * 1e3))
    row("kv_handoff_2048", name, "added_ttft_fraction", h["ms"] / p["ms"], "prefill_ms", p["ms"], None)
    row("kv_handoff_2048", name, "bytes", h["bytes"])
    del runner, allocator
    gc.collect()
    torch.cuda.empty_cache()


def _weights_and_decode(runner, allocator, name: str, ceil: dict, batches: list[int], suffix: str = "") -> None:
    """The weights row and a decode row per batch against the bandwidth floor (the bytes a step reads)."""
    bw = ceil["hbm_copy_TBps"] * 1e12
    wbytes = weight_bytes(runner)
    row(f"weights{suffix}", name, "GB", wbytes / 1e9)
    for batch in batches:
        r = decode_workload(runner, allocator, batch)
        floor_ms = (wbytes + r["kv_read_bytes"]) / bw * 1e3
        row(f"decode_b{batch}{suffix}", name, "ms_per_step", r["ms_per_step"], "bandwidth_floor_ms", floor_ms,
            r["ms_per_step"] / floor_ms)
        row(f"decode_b{batch}{suffix}", name, "out_tok_per_s", r["out_tok_per_s"])


def run_model_fp8(name: str, ceil: dict, batches: list[int], kv_cache_dtype: str = "auto",
                  suffix: str = "_fp8") -> None:
    """The same model with FP8 weights (and, with ``kv_cache_dtype`` "fp8", an FP8 KV cache too):
    rows suffixed ``suffix``, each decode step and the prefill also against the bf16 ones."""
    from tandem.engine.block_allocator import BlockAllocator

    max_batch = max(batches)
    runner = build_runner(name, num_tokens=max_batch * 400 + 2 * 2048 + 1024, max_seq_len=4096,
                          max_batch_size=max_batch, quantization="fp8", kv_cache_dtype=kv_cache_dtype)
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    _weights_and_decode(runner, allocator, name, ceil, batches, suffix=suffix)
    measured = {(r["workload"], r["metric"]): r["value"] for r in ROWS if r["model"] == name}
    for batch in batches:
        fp8_ms = measured.get((f"decode_b{batch}{suffix}", "ms_per_step"))
        bf16_ms = measured.get((f"decode_b{batch}", "ms_per_step"))
        if isinstance(fp8_ms, float) and isinstance(bf16_ms, float):
            row(f"decode_b{batch}{suffix}", name, "speedup_vs_bf16", bf16_ms / fp8_ms, "bf16_ms_per_step", bf16_ms,
                None)
    p = prefill_workload(runner, allocator)
    rate = ceil.get("fp8_matmul_TFLOPs") or ceil["bf16_matmul_TFLOPs"]
    row(f"prefill_2048{suffix}", name, "ms", p["ms"], "fp8_matmul_floor_ms", p["flops"] / (rate * 1e12) * 1e3,
        None)
    row(f"prefill_2048{suffix}", name, "fraction_of_fp8_matmul_rate", p["flops"] / (p["ms"] / 1e3) / (rate * 1e12))
    bf16_ms = measured.get(("prefill_2048", "ms"))
    if isinstance(bf16_ms, float):
        row(f"prefill_2048{suffix}", name, "speedup_vs_bf16", bf16_ms / p["ms"], "bf16_ms", bf16_ms, None)
    del runner, allocator
    gc.collect()
    torch.cuda.empty_cache()


LONG_CONTEXT = (8, 2048, 64)  # batch, prompt, new tokens: a decode whose KV read weighs most


def run_model_fp8kv(name: str, ceil: dict, batches: list[int]) -> None:
    """The same model with an FP8 KV cache (--kv-cache-dtype fp8; scales calibrated at build): rows
    suffixed _fp8kv, each against the bf16-cache row of this run, and the long-context decode with
    both caches around one set of weights."""
    from tandem.engine.block_allocator import BlockAllocator
    from tandem.engine.runner import ModelRunner

    max_batch = max(batches)
    runner = build_runner(name, num_tokens=max_batch * 400 + 2 * 2048 + 1024, max_seq_len=4096,
                          max_batch_size=max_batch, kv_cache_dtype="fp8")
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    _weights_and_decode(runner, allocator, name, ceil, batches, suffix="_fp8kv")
    measured = {(r["workload"], r["metric"]): r["value"] for r in ROWS if r["model"] == name}
    for batch in batches:
        ours = measured.get((f"decode_b{batch}_fp8kv", "ms_per_step"))
        bf16 = measured.get((f"decode_b{batch}", "ms_per_step"))
        if isinstance(ours, float) and isinstance(bf16, float):
            row(f"decode_b{batch}_fp8kv", name, "speedup_vs_bf16_kv", bf16 / ours, "bf16_kv_ms_per_step", bf16, None)
    p = prefill_workload(runner, allocator)
    bf16 = measured.get(("prefill_2048", "ms"))
    row("prefill_2048_fp8kv", name, "ms", p["ms"], "bf16_kv_ms", bf16,
        bf16 / p["ms"] if isinstance(bf16, float) else None)
    h = handoff_workload(runner, allocator)
    row("kv_handoff_2048_fp8kv", name, "GBps", h["GBps"], "hbm_copy_GBps", ceil["hbm_copy_TBps"] * 1e3,
        h["GBps"] / (ceil["hbm_copy_TBps"] * 1e3))
    row("kv_handoff_2048_fp8kv", name, "added_ttft_fraction", h["ms"] / p["ms"], "prefill_ms", p["ms"], None)
    row("kv_handoff_2048_fp8kv", name, "bytes", h["bytes"], "bf16_kv_bytes",
        measured.get(("kv_handoff_2048", "bytes")), None)
    batch, prompt_len, new_tokens = LONG_CONTEXT
    batch = min(batch, runner.num_blocks * runner.block_size // (prompt_len + new_tokens))
    dense = ModelRunner.from_model(runner.model, runner.config, runner.num_blocks, runner.block_size)
    dense.enable_cuda_graphs(max_batch, 4096)
    times = {}
    for suffix, r in (("", dense), ("_fp8kv", runner)):
        d = decode_workload(r, BlockAllocator(r.num_blocks, r.block_size), batch, prompt_len, new_tokens)
        floor_ms = (weight_bytes(r) + d["kv_read_bytes"]) / (ceil["hbm_copy_TBps"] * 1e12) * 1e3
        times[suffix] = d["ms_per_step"]
        row(f"decode_b{batch}_ctx{prompt_len}{suffix}", name, "ms_per_step", d["ms_per_step"], "bandwidth_floor_ms",
            floor_ms, d["ms_per_step"] / floor_ms)
    row(f"decode_b{batch}_ctx{prompt_len}_fp8kv", name, "speedup_vs_bf16_kv", times[""] / times["_fp8kv"],
        "bf16_kv_ms_per_step", times[""], None)
    del runner, dense, allocator
    gc.collect()
    torch.cuda.empty_cache()


def run_anchors(name: str, which: set[str]) -> None:
    from tandem.bench import hf_anchors

    model, config = hf_anchors.build_hf(name)
    ours = {(r["workload"], r["metric"]): r["value"] for r in ROWS if r["model"] == name}

    def compare(workload, metric, anchor, anchor_value, higher_is_better=True):
        value = ours.get((workload, metric))
        ratio = None if value is None else (value / anchor_value if higher_is_better else anchor_value / value)
        row(workload, name, metric, value, anchor, anchor_value, ratio)

    steps = {
        "static": lambda: [
            compare("decode_b1", "out_tok_per_s", "hf_static_compiled",
                    hf_anchors.static_compiled(model, config, 1, 128, 256)["out_tok_per_s"]),
            compare("decode_b64", "out_tok_per_s", "hf_static_compiled",
                    hf_anchors.static_compiled(model, config, 64, 128, 256)["out_tok_per_s"]),
        ],
        "eager": lambda: compare("decode_b1", "out_tok_per_s", "hf_eager",
                                 hf_anchors.eager(model, config, 1, 128, 256)["out_tok_per_s"]),
        "prefill": lambda: compare("prefill_2048", "ms", "hf_prefill_ms",
                                   hf_anchors.prefill(model, config)["prefill_ms"], higher_is_better=False),
        "cb": lambda: row("mixed_128req", name, "hf_cb_out_tok_per_s",
                          hf_anchors.continuous_batching(model, config)["out_tok_per_s"]),
    }
    for key in ("prefill", "static", "eager", "cb"):
        if key in which:
            try:
                steps[key]()
            except Exception as exc:  # a partial table beats none
                traceback.print_exc()
                row(f"anchor_{key}", name, "error", f"{type(exc).__name__}: {exc}"[:300])
    del model
    gc.collect()
    torch.cuda.empty_cache()


def _guided_tokenizer(args) -> str | None:
    """The guided row's tokenizer: --guided-tokenizer, else the default model's when installed."""
    if args.guided_tokenizer:
        return args.guided_tokenizer
    from tandem.models import default_gguf_file

    path = default_gguf_file()
    return str(path) if path is not None else None


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':<18} {'model':<12} {'metric':<24} {'value':>12} {'anchor':<20} {'anchor_value':>12} {'ratio':>7}")
    for r in rows:
        def fmt(x):
            return f"{x:12.4g}" if isinstance(x, (int, float)) else f"{str(x or ''):>12}"
        ratio = f"{r['ratio']:7.3f}" if isinstance(r["ratio"], (int, float)) else ""
        print(f"{r['workload']:<18} {r['model']:<12} {r['metric']:<24} {fmt(r['value'])} "
              f"{str(r['anchor'] or ''):<20} {fmt(r['anchor_value'])} {ratio:>7}")


def main(args: argparse.Namespace) -> int:
    from tandem.bench.timing import ceilings, fp8_matmul_TFLOPs

    import transformers
    import triton

    if not torch.cuda.is_available():
        print("tandem bench engine measures the GPU path: no CUDA device here", file=sys.stderr)
        return 2

    env = dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
               gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"))
    print(env, flush=True)
    ceil = ceilings()
    row("ceilings", "-", "hbm_copy_TBps", ceil["hbm_copy_TBps"])
    row("ceilings", "-", "bf16_matmul_TFLOPs", ceil["bf16_matmul_TFLOPs"])
    fp8 = args.quantization == "fp8"
    if fp8:
        ceil["fp8_matmul_TFLOPs"] = fp8_matmul_TFLOPs()
        row("ceilings", "-", "fp8_matmul_TFLOPs", ceil["fp8_matmul_TFLOPs"])
    batches = [int(b) for b in args.batches.split(",")]
    anchors = {a for a in args.anchors.split(",") if a}
    anchor_models = set(args.anchor_models.split(","))
    for name in args.models.split(","):
        try:
            run_model(name, ceil, batches, _guided_tokenizer(args))
        except Exception as exc:
            traceback.print_exc()
            row("engine", name, "error", f"{type(exc).__name__}: {exc}"[:300])
        if fp8:
            try:
                run_model_fp8(name, ceil, batches)
            except Exception as exc:
                traceback.print_exc()
                row("engine_fp8", name, "error", f"{type(exc).__name__}: {exc}"[:300])
        if args.kv_cache_dtype == "fp8":
            try:
                run_model_fp8kv(name, ceil, batches)
            except Exception as exc:
                traceback.print_exc()
                row("engine_fp8kv", name, "error", f"{type(exc).__name__}: {exc}"[:300])
        if fp8 and args.kv_cache_dtype == "fp8":  # both: what an FP8 cluster runs
            try:
                run_model_fp8(name, ceil, batches, kv_cache_dtype="fp8", suffix="_fp8_fp8kv")
            except Exception as exc:
                traceback.print_exc()
                row("engine_fp8_fp8kv", name, "error", f"{type(exc).__name__}: {exc}"[:300])
        if anchors and name in anchor_models:
            run_anchors(name, anchors)
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": ROWS}, f, indent=1)
    print_table(ROWS)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
