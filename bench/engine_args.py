"""Command-line flags of `tandem bench engine`, torch-free so the CLI can list them cheaply."""

import argparse

from tandem.bench.shapes import SHAPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--anchors", default="prefill,static,eager,cb", help="HF anchors to run ('' for none)")
    parser.add_argument("--anchor-models", default="llama2-7b")
    parser.add_argument("--out", default="benchmarks.json")
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"],
                        help="fp8: each model again with FP8 weights (its projections quantized per output "
                             "channel), rows suffixed _fp8: weights, decode at --batches, prefill 2048")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: each model again with an FP8 KV cache (bf16 weights), rows suffixed _fp8kv: "
                             "decode at --batches, prefill 2048, the KV handoff, and decode at 2048 tokens of context")
    parser.add_argument("--guided-tokenizer", default=None,
                        help="a checkpoint (or tokenizer directory) for the guided decode row "
                             "(default: the default model's; none installed: the row is skipped)")
