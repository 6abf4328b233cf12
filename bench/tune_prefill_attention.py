"""Sweep the prefill attention kernel's tile settings at the benchmark shapes (GPU).

    python3 -m tandem.bench.tune_prefill_attention --out $OUT/tune_prefill.json [--models llama2-7b] [--tokens 2048]

For one fresh prompt of ``--tokens`` tokens (its keys in the pool's blocks in
order, as a new request's are, and given as chunk_kv as the engine does: v a view of a
fused QKV output) on the llama2-7b, llama3-8b and llama3.2-1b shapes, times the kernel
with the shape rule's settings, the rule reading every key through the block table
("paged"), and every (BLOCK_M, BLOCK_N, num_warps, num_stages, heavy_first) of GRID, checks each
against torch's fused SDPA (causal, dense), and prints the best against the
rule and against SDPA's time, in TFLOP/s of causal attention (2 * S^2 * Hq * D
multiply-adds, the half of the square below the diagonal).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tandem.bench.timing import median_ms
from tandem.kernels.prefill_attention import _launch_prefill_attention

SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128), "llama3.2-1b": (32, 8, 64)}  # Hq, Hkv, D
# (BLOCK_M, BLOCK_N, num_warps, num_stages, heavy_first)
GRID = (list(itertools.product((128,), (64, 128), (4, 8), (2, 3, 4), (True,)))
        + list(itertools.product((64,), (64, 128), (4,), (2, 3, 4), (True,))))


def run_case(name: str, tokens: int, block_size: int = 16) -> dict:
    hq, hkv, d = SHAPES[name]
    q = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    num_blocks = -(-tokens // block_size)
    k = torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_chunk = k.view(-1, hkv, d)[:tokens]  # contiguous, as rotary_kv_write's k output
    qkv = torch.empty(tokens, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16)
    qkv[:, hq + hkv:] = v.view(-1, hkv, d)[:tokens]
    chunk_kv = (k_chunk, qkv[:, hq + hkv:])  # v: a strided view, as the engine's
    tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32)[None]
    qsl = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
    scale = d**-0.5
    # SDPA on the same keys laid out densely: [1, H, S, D]
    qd = q.transpose(0, 1)[None]
    kd = k.view(-1, hkv, d)[:tokens].transpose(0, 1)[None].contiguous()
    vd = v.view(-1, hkv, d)[:tokens].transpose(0, 1)[None].contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=hkv != hq)  # noqa: E731
    ref = sdpa()[0].transpose(0, 1).float()
    flops = 2 * tokens * tokens * hq * d
    sdpa_ms = median_ms(sdpa, reps=20, warmup=3)
    out = torch.empty_like(q)
    rows = []
    for config in [None, "paged"] + GRID:
        fn = lambda: _launch_prefill_attention(  # noqa: E731
            q, k, v, tables, qsl, lens, out, scale, None, None if config == "paged" else chunk_kv,
            None if config == "paged" else config)
        try:
            out.fill_(float("nan"))
            fn()
            if not torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2):
                print(f"  {name} {config}: wrong answer", flush=True)
                continue
            ms = median_ms(fn, reps=20, warmup=3)
        except Exception as exc:  # a tile that does not fit shared memory
            print(f"  {name} {config}: {type(exc).__name__}", flush=True)
            continue
        rows.append({"config": config, "ms": ms, "tflops": flops / ms / 1e9})
    rule = next(r for r in rows if r["config"] is None)
    paged = next(r for r in rows if r["config"] == "paged")
    best = min(rows, key=lambda r: r["ms"])
    return {"model": name, "tokens": tokens, "sdpa_ms": sdpa_ms, "sdpa_tflops": flops / sdpa_ms / 1e9,
            "rule": rule, "paged": paged, "best": best, "top5": sorted(rows, key=lambda r: r["ms"])[:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="tune_prefill.json")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    results = []
    for name in args.models.split(","):
        r = run_case(name, args.tokens)
        results.append(r)
        print(f"{name:11s} {args.tokens} tokens: SDPA {r['sdpa_ms']:.3f} ms ({r['sdpa_tflops']:.0f} TFLOP/s)  "
              f"rule {r['rule']['ms']:.3f} ms ({r['rule']['tflops']:.0f})  paged {r['paged']['ms']:.3f}  best {r['best']['ms']:.3f} ms "
              f"({r['best']['tflops']:.0f}) {r['best']['config']}", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
