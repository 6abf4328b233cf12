"""The cost of LoRA in a decode step: llama-shaped random weights, a batch of decode rows as
the decode worker runs them (CUDA graphs), each row of the base model, all of one adapter, or
spread over several adapters (rank 16 on all seven projections by default).

    python3 -m tandem.bench.lora_step --model llama3-8b --batch 64 --adapters 8 [--quantization fp8 ...]
        [--fuse off]   the A stacks apart from the weights (default: where LoraWeights.fuse_into puts them)

Prints and writes one row per case, with its ratio to the base step.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from tandem.bench.decode_profile import kernel_table
from tandem.bench.random_lora import write_random_adapters
from tandem.bench.shapes import hf_config_dict
from tandem.bench.timing import median_ms


def build(model: str, batch: int, context: int, num_adapters: int, rank: int, quantization: str | None,
          kv_cache_dtype: str, directory: str, fuse: bool | None = None):
    """-> (runner with ``num_adapters`` adapters in device slots and CUDA graphs, decode rows)."""
    from tandem.engine.attention import SeqChunk
    from tandem.engine.config import ModelConfig
    from tandem.engine.loader import random_model
    from tandem.engine.runner import ModelRunner

    block = 16
    config = ModelConfig.from_dict(hf_config_dict(model))
    weights = random_model(config, torch.bfloat16, "cuda", quantization=quantization)
    blocks_per_seq = -(-(context + 1) // block)
    runner = ModelRunner.from_model(weights, config, num_blocks=batch * blocks_per_seq + 1, block_size=block,
                                    kv_cache_dtype=kv_cache_dtype)
    lora = runner.enable_lora(max_loras=num_adapters, max_rank=rank, fuse=fuse)
    names = []
    for name, path in write_random_adapters(config, directory, num_adapters, rank).items():
        lora.add(name, path)
        names.append(name)
    slots = lora.slots_for(names)
    runner.enable_cuda_graphs(batch, context + 16)
    rows = [SeqChunk([7 + i], context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
            for i in range(batch)]
    return runner, rows, [slots[n] for n in names]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="tokens each row has before its step")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--fuse", default="auto", choices=["auto", "off"],
                        help="the A stacks under the weights where the rule puts them (auto), or apart")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from tandem.engine.attention import SeqChunk

    with tempfile.TemporaryDirectory() as directory:
        runner, rows, slots = build(args.model, args.batch, args.context, args.adapters, args.rank,
                                    args.quantization, args.kv_cache_dtype, directory,
                                    fuse=None if args.fuse == "auto" else False)

    def with_slots(assign):
        return [SeqChunk(r.token_ids, r.num_computed, r.block_ids, lora_slot=assign(i)) for i, r in enumerate(rows)]

    cases = {"base": with_slots(lambda i: -1), "1 adapter": with_slots(lambda i: slots[0]),
             f"{len(slots)} adapters": with_slots(lambda i: slots[i % len(slots)])}
    assert all(runner.graphs.can_run(c) for c in cases.values())
    common = dict(model=args.model, batch=args.batch, context=args.context, rank=args.rank,
                  dtype="fp8" if args.quantization == "fp8" else "bf16",
                  kv_dtype="fp8" if args.kv_cache_dtype == "fp8" else "bf16",
                  fused_projections=sum(s.weight is not None for layer in runner.lora.weights.layers
                                        for s in layer.values()))
    result, base_ms = [], None
    for case, chunks in cases.items():
        ms = median_ms(lambda: runner.forward(chunks), reps=50, warmup=5)
        base_ms = base_ms or ms
        # the kernels' device time, launched one by one (a graph replays the same kernels)
        graphs, runner.graphs = runner.graphs, None
        try:
            kernels = kernel_table(lambda: runner.forward(chunks))
        finally:
            runner.graphs = graphs
        lora_us = sum(us for name, us in kernels.items() if "lora" in name.lower())
        result.append(dict(common, case=case, step_ms=ms, ratio_to_base=ms / base_ms, kernels_us=kernels,
                           kernels_total_us=sum(kernels.values()), lora_kernels_us=lora_us))
        print(f"lora_step {args.model} batch {args.batch} {common['dtype']} fused {common['fused_projections']}: "
              f"{case}: {ms:.3f} ms "
              f"({ms / base_ms:.3f}x base); kernels {sum(kernels.values()):.0f} us, of them LoRA {lora_us:.0f} us "
              f"in {sum(1 for n in kernels if 'lora' in n.lower())} kinds", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
