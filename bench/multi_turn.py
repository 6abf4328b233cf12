"""``tandem bench multi-turn``: conversations whose every turn sends the whole conversation so far.

The workload of multi-turn chat, where prefix caching and a host KV tier pay (vLLM's
``benchmark_serving_multi_turn``, SGLang's HiCache runs): each conversation opens with a long
first prompt (a document, a system prompt), then each turn sends the previous prompt, the
server's answer to it (the token ids it streamed back: ``return_token_ids``) and a new
question. ``--max-concurrency`` clients take conversations in turn: a conversation whose turn
is answered goes to the back of the line, so between two of its turns every other conversation
has one, and the working set is every conversation's history at once. With it larger than the
device KV pool, a conversation's prefix is gone from the device by its next turn: recomputed,
or copied back from the host tier (``--kv-host-cache-gb``).

    tandem bench multi-turn --base-url http://127.0.0.1:8000 --num-conversations 64 \\
        --num-turns 6 --first-len 2048 --question-len 64 --answer-len 256 --max-concurrency 16

Reports time to first token (every turn, and the later turns alone: those that can reuse a
prefix), output tokens per second over the run, and the share of later turns' prompt tokens the
server reported as cached (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter, deque

import httpx
import numpy as np

from tandem.bench.datasets import RequestSpec
from tandem.bench.serve_metrics import RequestResult, summarize
from tandem.bench.serve_request import BenchConfig, fetch_model, send_request

PERCENTILES = (50, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="", help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-conversations", type=int, default=64)
    parser.add_argument("--num-turns", type=int, default=6)
    parser.add_argument("--first-len", type=int, default=2048, help="tokens of each conversation's first prompt")
    parser.add_argument("--question-len", type=int, default=64, help="tokens each later turn adds")
    parser.add_argument("--answer-len", type=int, default=256, help="max_tokens of every turn (ignore_eos)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="conversations with a turn in flight")
    parser.add_argument("--min-token-id", type=int, default=3)
    parser.add_argument("--max-token-id", type=int, default=499, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-vocab-size", type=int, default=None,
                        help="answer ids at or above this are replaced in the next prompt (a model whose "
                             "vocabulary exceeds its tokenizer's; default: none replaced)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--result-json", default=None)


def history_len(args: argparse.Namespace) -> int:
    """The longest prompt plus answer the workload sends: the last turn's."""
    return args.first_len + (args.num_turns - 1) * (args.answer_len + args.question_len) + args.answer_len


async def run(args: argparse.Namespace, cfg: BenchConfig) -> tuple[list[tuple[int, int, RequestResult]], float]:
    """-> ((conversation, turn, result) per turn sent, the run's seconds)."""
    rng = np.random.default_rng(args.seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(args.min_token_id, args.max_token_id, n).tolist()

    histories = [tokens(args.first_len) for _ in range(args.num_conversations)]
    turns = [0] * args.num_conversations
    line = deque(range(args.num_conversations))
    results: list[tuple[int, int, RequestResult]] = []
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)

    async def client(http: httpx.AsyncClient) -> None:
        while line:
            conv = line.popleft()
            turn, prompt = turns[conv], histories[conv]
            spec = RequestSpec(index=len(results), prompt=prompt, prompt_len=len(prompt), output_len=args.answer_len)
            res = RequestResult(index=spec.index, prompt_len=spec.prompt_len, output_len=spec.output_len)
            results.append((conv, turn, res))
            res.start = time.perf_counter() - start
            await send_request(http, cfg, spec, res)
            if not res.success:
                continue  # the conversation ends here: its next prompt would need this answer
            answer = res.token_ids
            if args.prompt_vocab_size:  # ids the server accepts in a prompt: a model's may pass its tokenizer's
                answer = [t if t < args.prompt_vocab_size else args.min_token_id for t in answer]
            turns[conv] += 1
            if turns[conv] < args.num_turns:
                histories[conv] = prompt + answer + tokens(args.question_len)
                line.append(conv)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits, trust_env=False) as http:
        await asyncio.gather(*(client(http) for _ in range(args.max_concurrency)))
    return results, time.perf_counter() - start


def report(results: list[tuple[int, int, RequestResult]], duration: float) -> dict:
    done = [(c, t, r) for c, t, r in results if r.success]
    later = [r for _, t, r in done if t > 0]
    prompt_later = sum(r.usage_prompt_tokens or r.prompt_len for r in later)
    cached_later = sum(r.usage_cached_tokens or 0 for r in later)
    output = sum(r.output_tokens for _, _, r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration": duration,
        "output_tokens": output, "output_throughput": output / duration if duration else None,
        "prompt_tokens": sum(r.usage_prompt_tokens or r.prompt_len for _, _, r in done),
        "ttft_ms": summarize([r.ttft * 1000 for _, _, r in done], PERCENTILES),
        "ttft_ms_later_turns": summarize([r.ttft * 1000 for r in later], PERCENTILES),
        "tpot_ms": summarize([r.tpot * 1000 for _, _, r in done if r.tpot is not None], PERCENTILES),
        "cached_fraction_later_turns": cached_later / prompt_later if prompt_later else None,
        "errors": [{"error": e, "count": n} for e, n in Counter(r.error for _, _, r in results if not r.success).items()],
    }


def main(args: argparse.Namespace) -> int:
    cfg = BenchConfig(base_url=args.base_url, model=args.model, api_key=args.api_key,
                      request_timeout=args.request_timeout, extra_body={"return_token_ids": True})
    if not cfg.model:
        try:
            cfg.model = asyncio.run(fetch_model(args.base_url, args.api_key))
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"bench multi-turn: no model: {exc}", file=sys.stderr)
            return 2
    results, duration = asyncio.run(run(args, cfg))
    metrics = report(results, duration)
    print(f"bench multi-turn: {metrics['completed']} turns ({metrics['failed']} failed) in {duration:.1f} s; "
          f"out {metrics['output_throughput'] or 0:.0f} tok/s; TTFT p50 {metrics['ttft_ms']['p50'] or 0:.0f} ms "
          f"(later turns {metrics['ttft_ms_later_turns']['p50'] or 0:.0f} ms); later turns' prompt tokens cached: "
          f"{(metrics['cached_fraction_later_turns'] or 0):.0%}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"config": vars(args), "metrics": metrics}, f, indent=1)
            f.write("\n")
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
