"""What structured outputs cost a decode step: batch 64 with half its rows guided, against the
same steps unguided.

    python -m tandem.bench.guided_decode [--device cpu|cuda] [--model llama3-8b] [--tokenizer DIR]

Both runs go through the decode worker's own ``DeviceSteps`` (steps launched ahead, CUDA
graphs on a GPU), greedy. In the guided one every other row follows a JSON schema (an array of
integers long enough to stay open for the whole run), so each step waits for the previous
step's tokens, advances 32 llguidance matchers, fills their bitmask while the forward runs,
copies it to the device and masks the logits. The tokenizer is a real one (default: the
default model's, SmolLM2's 49,152 tokens; ``--tokenizer`` names another checkpoint's); the
logits are the model shape's (ids past the tokenizer are never allowed). ``tandem bench
engine`` runs it on each GPU model shape (row ``decode_b64_guided_half``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from tandem.bench.sampling_controls import _runner, decode_ms
from tandem.cluster import grammars
from tandem.cluster.sampling import SamplingParams
from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.guide import Guides

SCHEMA = {"type": "array", "minItems": 500, "maxItems": 500, "items": {"type": "integer", "minimum": 0,
                                                                       "maximum": 999}}


def overhead(runner, allocator: BlockAllocator, tokenizer_source: str, batch: int = 64, rounds: int = 3) -> dict:
    """Median ms per step unguided and with every other row guided, taking turns."""
    guides = Guides(tokenizer_source, runner.config.vocab_size, list(runner.config.eos_token_ids))
    grammar = grammars.json_schema_grammar(SCHEMA)
    plain = [SamplingParams(temperature=0.0)] * batch
    guided = [SamplingParams(temperature=0.0, grammar=grammar if r % 2 == 0 else None) for r in range(batch)]
    first = _open_bracket(tokenizer_source)  # every row's first token: the array's "[" (valid for the guides)
    times = {"plain": [], "guided": []}
    decode_ms(runner, allocator, plain, new_tokens=12, first_token=first)  # warm-up: graphs, the tokenizer
    decode_ms(runner, allocator, guided, new_tokens=12, guides=guides, first_token=first)
    for _ in range(rounds):
        times["plain"].append(decode_ms(runner, allocator, plain, first_token=first))
        times["guided"].append(decode_ms(runner, allocator, guided, guides=guides, first_token=first))
    plain_ms, guided_ms = statistics.median(times["plain"]), statistics.median(times["guided"])
    return {"plain_ms": plain_ms, "guided_ms": guided_ms, "ratio": guided_ms / plain_ms,
            "guided_rows": sum(p.grammar is not None for p in guided)}


def _open_bracket(tokenizer_source: str) -> int:
    from tandem.cluster.tokenizer import load_tokenizer

    ids = load_tokenizer(tokenizer_source).encode("[", add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


def default_tokenizer() -> str:
    from tandem.models import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="llama3-8b", help="a model shape of tandem.bench.shapes (GPU)")
    parser.add_argument("--tokenizer", help="a checkpoint whose tokenizer the grammars use (default: the default model)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    runner = _runner(args)
    allocator = BlockAllocator(runner.kv_pool.num_blocks, runner.block_size)
    result = overhead(runner, allocator, args.tokenizer or default_tokenizer(), args.batch, args.rounds)
    print(json.dumps({"device": str(runner.device), "model": "tiny" if args.device == "cpu" else args.model,
                      "batch": args.batch, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
