"""What the quality tests of a quantized model measure, the same way for every form of it (FP8
weights, FP8 KV cache, both): the default model SmolLM2-135M-Instruct (its GGUF file, dequantized
to fp32) through the engine's ModelRunner on the CPU.

- ``perplexity``: on a fixed English text, tests/data/pride_and_prejudice_ch1.txt (the opening
  of Jane Austen's Pride and Prejudice, 1813, public domain), one prefill;
- ``greedy``: 8 prompts decoded for 64 tokens each in one batch (prefill, then decode steps);
- ``greedy_choices``: a model's greedy choice at each position of another's greedy continuation
  (the same prefix fed to both: teacher forcing), compared with ``same_tokens``. Comparing two
  free-running continuations position by position counts every token after the first flip as
  wrong, and a 135M model's greedy path has near-ties: with an FP8 KV cache the first flips came
  at positions 3-40 at logit margins of 0.003-0.07 (2026-12-02, the 2-core CPU machine: 283 of 512
  tokens equal free-running, 499 of 512 choices equal).

(A module of helpers with a unique name: tests/engine has no package.)
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tandem.engine.attention import SeqChunk

TEXT = Path(__file__).resolve().parents[1] / "data" / "pride_and_prejudice_ch1.txt"
BLOCK_SIZE = 16
MAX_POSITION = 1024
NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which plants",
    "The history of the Roman Empire began",
]
NUM_BLOCKS = MAX_POSITION // BLOCK_SIZE * len(PROMPTS)  # a runner's pool: every prompt's sequence at once


def default_model_state():
    """(config dict, HF-named fp32 tensors) of the default model's GGUF file, read once."""
    from tandem.cluster.checkpoint import gguf_file
    from tandem.engine.gguf_checkpoint import read_gguf_checkpoint
    from tandem.models import DEFAULT_MODEL, resolve_model

    return read_gguf_checkpoint(gguf_file(resolve_model(DEFAULT_MODEL)), torch.float32, "cpu")


def perplexity(runner, ids: list[int], chunk: int | None = None) -> float:
    """exp(mean NLL) of ``ids[1:]``; ``chunk``: prefilled that many tokens a forward, so that each
    chunk's queries read the earlier chunks' keys and values from the KV cache (a forward reads
    its own chunk's from its QKV output, never the cache)."""
    blocks = list(range(-(-len(ids) // BLOCK_SIZE)))
    chunk = chunk or len(ids)
    hidden = torch.cat([runner.forward_hidden([SeqChunk(ids[start:start + chunk], start, blocks)])[1]
                        for start in range(0, len(ids), chunk)])
    logprobs = torch.log_softmax(runner.compute_logits(hidden[:-1]), dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


def greedy(runner, prompts: list[list[int]]) -> list[list[int]]:
    """NEW_TOKENS greedy tokens of each prompt, all decoded in one batch."""
    per_seq = MAX_POSITION // BLOCK_SIZE
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    logits = runner.forward([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])
    out = [[int(t)] for t in logits.argmax(-1)]
    for step in range(NEW_TOKENS - 1):
        chunks = [SeqChunk([tokens[-1]], len(p) + step, b) for p, tokens, b in zip(prompts, out, blocks)]
        for tokens, t in zip(out, runner.forward(chunks).argmax(-1)):
            tokens.append(int(t))
    return out


def greedy_choices(runner, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The runner's argmax after each prefix prompt + continuation[:i], i < len(continuation): its
    greedy token at every position of the given continuations (one batch, decode steps fed them)."""
    per_seq = MAX_POSITION // BLOCK_SIZE
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    logits = runner.forward([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])
    out = [[int(t)] for t in logits.argmax(-1)]
    for step in range(len(continuations[0]) - 1):
        chunks = [SeqChunk([c[step]], len(p) + step, b) for p, c, b in zip(prompts, continuations, blocks)]
        for tokens, t in zip(out, runner.forward(chunks).argmax(-1)):
            tokens.append(int(t))
    return out


def same_tokens(reference: list[list[int]], other: list[list[int]]) -> tuple[int, int, list[int | None]]:
    """-> (tokens equal position by position, tokens in all, each prompt's first differing position)."""
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    first = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(reference, other)]
    return same, sum(len(r) for r in reference), first
