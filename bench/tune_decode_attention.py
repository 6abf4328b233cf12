"""Sweep the decode attention kernel's tile settings at the benchmark shapes (GPU).

    python3 -m tandem.bench.tune_decode_attention --out $OUT/tune_decode.json

For each (batch, context) of the decode workloads on the llama2-7b and
llama3-8b shapes, times the kernel with the shape rules' settings and with
every (BLOCK_N, num_warps, num_stages, num_splits) of a small grid, checks each
against the torch reference, and prints the best against the rule, as a
fraction of the measured copy bandwidth (K and V bytes read). Each timing
replays 10 launches captured in one CUDA graph, so the GPU time is measured,
not the Python launch (before, launched one by one, the small GQA cases timed
the launch: 50-80 us).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from tandem.bench.timing import ceilings, graph_ms
from tandem.kernels import reference
from tandem.kernels import decode_config, switches
from tandem.kernels.decode_attention import _launch_decode_attention

SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128), "llama3.2-1b": (32, 8, 64)}  # q heads, kv heads, head_dim
# (batch, context, scattered): scattered block tables are a long-running pool's; in order, a fresh one's.
# (Batch 1 is left out: outside a CUDA graph its time is the Python launch's.)
CASES = [(64, 256, True), (128, 416, True), (128, 416, False)]
INNER = 10  # launches per captured graph
# (BLOCK_N, num_warps, num_stages, num_splits, heads_first); first the rule, in both grid orders
GRID = list(itertools.product((32, 64), (4,), (2, 3), (1, 2), (True,)))
# --wide: more tiles, warps, stages and splits (the batch-64 x context-256 case sits at ~80% with the rule)
WIDE_GRID = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 3, 4), (True,)))
# --tiles: the wide grid's tiles at the splits the rule picks for the case (grid size from shapes)
TILES = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))


def run_case(name, batch, context, scattered, copy_bw, grid=GRID, head_major=False):
    """``head_major``: the cache's blocks laid out [head, slot, dim] in memory (a view still
    indexed [block, slot, head, dim]), so one head's slots of a block are contiguous."""
    hq, hkv, d = SHAPES[name]
    block_size = 16
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 8
    if head_major:
        k = torch.randn(num_blocks, hkv, block_size, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(num_blocks, hkv, block_size, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        k = torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks - 8, device="cuda") if scattered else torch.arange(num_blocks - 8, device="cuda")
    perm = perm[: batch * blocks_per_seq].to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = d**-0.5
    ref = reference.decode_attention(q.float(), k.float(), v.float(), tables, lens, scale)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * context * hkv * d * 2
    rows, wrong = [], []
    for config in [None, "rule-seqs-first"] + grid:
        try:
            launch_config = config
            if config == "rule-seqs-first":  # the shape rule's tiles, sequences as the fastest grid axis
                launch_config = decode_config._tile_config(d, q.dtype, batch * hkv)[:3] + (
                    decode_config.num_kv_splits(batch, hkv, blocks_per_seq * block_size, q.device), False)
            fn = lambda: _launch_decode_attention(q, k, v, tables, lens, out, scale, None, None, launch_config)  # noqa: E731
            out.fill_(float("nan"))
            fn()
            if not torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2):
                print(f"WRONG ANSWER {name} b{batch} ctx{context} {config}", flush=True)
                wrong.append(config)
                continue
            ms = graph_ms([fn] * INNER)
        except Exception as exc:  # e.g. a tile that does not fit shared memory
            print(f"  {name} {config}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        rows.append({"config": config, "us": ms * 1e3, "bw_fraction": kv_bytes / (ms / 1e3) / copy_bw})
    rule = next(r for r in rows if r["config"] is None)
    seqs_first = next((r for r in rows if r["config"] == "rule-seqs-first"), None)
    best = min(rows, key=lambda r: r["us"])
    return {"model": name, "batch": batch, "context": context, "scattered": scattered, "head_major": head_major, "rule": rule, "rule_seqs_first": seqs_first, "best": best, "wrong_answers": wrong,
            "top5": sorted(rows, key=lambda r: r["us"])[:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="tune_decode.json")
    parser.add_argument("--cases", default="", help="batch:context[,...] (scattered tables) instead of the default cases")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--wide", action="store_true", help="sweep WIDE_GRID (72 settings) instead of GRID")
    parser.add_argument("--tiles", action="store_true",
                        help="sweep TILES (18 settings) at the rule's splits")
    parser.add_argument("--layouts", default="token", help="token,head: cache blocks [slot, head, dim] and/or [head, slot, dim]")
    args = parser.parse_args()
    cases = CASES
    if args.cases:
        cases = [(int(b), int(c), True) for b, c in (case.split(":") for case in args.cases.split(","))]
    grid = WIDE_GRID if args.wide else GRID
    if switches.current().decode_tile is not None:
        print(f"TANDEM_DECODE_TILE={switches.current().decode_tile}: the 'rule' rows use it", flush=True)
    copy_bw = ceilings()["hbm_copy_TBps"] * 1e12
    results = []
    for name in args.models.split(","):
        for batch, context, scattered in cases:
            if args.tiles:
                hkv, block_size = SHAPES[name][1], 16
                splits = decode_config.num_kv_splits(batch, hkv, -(-context // block_size) * block_size,
                                                        torch.device("cuda"))
                grid = [tile + (splits, True) for tile in TILES]
            for layout in args.layouts.split(","):
                r = run_case(name, batch, context, scattered, copy_bw, grid, head_major=layout == "head")
                results.append(r)
                print(f"{name:10s} b{batch:<4d} ctx{context:<5d} {layout:5s} {'scattered' if scattered else 'in-order '} "
                      f"rule {r['rule']['us']:8.1f} us ({r['rule']['bw_fraction']:.2f})  "
                      f"seqs-first {r['rule_seqs_first']['us']:8.1f} us ({r['rule_seqs_first']['bw_fraction']:.2f})  "
                      f"best {r['best']['us']:8.1f} us ({r['best']['bw_fraction']:.2f}) {r['best']['config']}", flush=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
