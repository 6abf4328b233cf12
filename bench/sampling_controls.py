"""What logit_bias and the penalties cost a decode step: batch 64, every row penalized, against
the same steps without.

    python -m tandem.bench.sampling_controls [--device cpu|cuda] [--model llama3-8b] [--batch 64]

Both runs go through the decode worker's own ``DeviceSteps`` (each step launched before the
previous one's tokens are read, input tokens fed on the device, CUDA graphs on a GPU), greedy;
the processed one gives every row a repetition penalty, presence and frequency penalties and
16 logit_bias entries, so each step gathers, updates and writes back a [64, V] block of counts
(the cost that scales with the vocabulary). The two take turns ``--rounds`` times and the
medians are compared. On the CPU it runs the tiny demo-shaped model (the code path, not a
measurement); ``tandem bench engine`` runs it on each GPU model shape (row
``decode_b64_penalties``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from tandem.cluster.messages import GenerateRequest
from tandem.cluster.request_state import RequestStatus
from tandem.cluster.sampling import SamplingParams
from tandem.cluster.step_stats import StepStats
from tandem.decode.device_steps import DeviceSteps
from tandem.decode.request import DecodeRequest
from tandem.engine.attention import SeqChunk
from tandem.engine.block_allocator import BlockAllocator


def processed_params(vocab: int, row: int) -> SamplingParams:
    """Every control that needs per-request counts, and a logit_bias, on one greedy row."""
    g = torch.Generator().manual_seed(row)
    bias = tuple((int(t), 0.5) for t in torch.randperm(vocab, generator=g)[:16])
    return SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                          logit_bias=bias)


def decode_ms(runner, allocator: BlockAllocator, params: list[SamplingParams], prompt_len: int = 128,
              new_tokens: int = 64, warmup: int = 8, guides=None, first_token: int | None = None) -> float:
    """ms per decode step of len(params) sequences (one per row) after a prompt of ``prompt_len``;
    ``guides`` (engine.guide.Guides): for rows whose params carry a grammar; ``first_token``: every
    row's first output token (default: its prompt's last)."""
    vocab = runner.config.vocab_size
    g = torch.Generator().manual_seed(len(params))
    steps = DeviceSteps(runner, allocator, StepStats("decode", 1e9), guides=guides)
    batch = []
    try:
        for i, p in enumerate(params):
            prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
            spec = GenerateRequest(request_id=f"b{i}", prompt_token_ids=prompt, sampling=p,
                                   max_tokens=new_tokens + 1, reply_to="bench", ignore_eos=True)
            batch.append(DecodeRequest(spec=spec, status=RequestStatus.DECODING,
                                       block_ids=allocator.allocate(prompt_len + new_tokens + 1),
                                       output_token_ids=[int(prompt[-1]) if first_token is None else first_token]))
        chunks = [SeqChunk(r.spec.prompt_token_ids, 0, r.block_ids) for r in batch]
        runner.forward(chunks)  # the prompts' KV (token 0 is taken as given)
        previous, started = None, None
        for step in range(new_tokens):
            if step == warmup:
                _sync(runner)
                started = time.perf_counter()
            error = steps.launch(batch, previous)
            if error is not None:
                raise error
            if previous is not None:  # read the step before while this one runs
                for r, token in zip(previous.batch, steps.read(previous)):
                    r.output_token_ids.append(token)
                    r.num_pending -= 1
            previous = steps.in_flight
        steps.read(previous)
        _sync(runner)
        return (time.perf_counter() - started) / (new_tokens - warmup) * 1e3
    finally:
        for r in batch:
            allocator.free(r.block_ids)


def overhead(runner, allocator: BlockAllocator, batch: int = 64, rounds: int = 3) -> dict:
    """Median ms per step without and with the controls on every row, taking turns."""
    vocab = runner.config.vocab_size
    plain = [SamplingParams(temperature=0.0)] * batch
    processed = [processed_params(vocab, r) for r in range(batch)]
    times = {"plain": [], "processed": []}
    decode_ms(runner, allocator, plain, new_tokens=12)  # warm-up: graphs, kernels, the slot buffer's first use
    decode_ms(runner, allocator, processed, new_tokens=12)
    for _ in range(rounds):
        times["plain"].append(decode_ms(runner, allocator, plain))
        times["processed"].append(decode_ms(runner, allocator, processed))
    plain_ms, processed_ms = statistics.median(times["plain"]), statistics.median(times["processed"])
    return {"plain_ms": plain_ms, "processed_ms": processed_ms, "ratio": processed_ms / plain_ms}


def _sync(runner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _runner(args: argparse.Namespace):
    from tandem.engine.runner import ModelRunner

    blocks = -(-args.batch * 400 // 16)
    if args.device == "cpu":
        from tandem.engine.demo_model import make_tiny_checkpoint

        path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="tandem-bench-"), "llama")
        return ModelRunner(path, num_blocks=blocks, block_size=16)
    from tandem.bench.shapes import hf_config_dict
    from tandem.engine.config import ModelConfig
    from tandem.engine.loader import random_model

    config = ModelConfig.from_dict(hf_config_dict(args.model))  # random bf16 weights, as tandem bench engine
    runner = ModelRunner.from_model(random_model(config, torch.bfloat16, "cuda"), config, num_blocks=blocks,
                                    block_size=16)
    runner.enable_cuda_graphs(args.batch, 1024)
    return runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="llama3-8b", help="a model shape of tandem.bench.shapes (GPU)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    runner = _runner(args)
    allocator = BlockAllocator(runner.kv_pool.num_blocks, runner.block_size)
    result = overhead(runner, allocator, args.batch, args.rounds)
    print(json.dumps({"device": str(runner.device), "model": "tiny" if args.device == "cpu" else args.model,
                      "batch": args.batch, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
