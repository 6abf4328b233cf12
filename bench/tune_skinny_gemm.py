"""The skinny GEMM against cuBLAS at decode batches (GPU), with a tile sweep.

    python3 -m tandem.bench.tune_skinny_gemm [--quick] [--batches 64,128] [--models llama2-7b,llama3-8b,llama3.2-1b]
                                      [--out $OUT/tune_skinny_gemm.json]

For every projection of a decode step (qkv, o, gate_up with its SiLU·mul, down,
lm_head) and every batch M, times torch's F.linear (cuBLAS; + the SiLU·mul kernel
for gate_up), the skinny GEMM with the shape rule, and a grid of settings; each is
checked against the fp32 reference first (a wrong one is printed and recorded, not
timed). Timings as bench.tune_gemv's: one CUDA graph cycling over enough copies of
the weight to leave the L2 cold. Bandwidth counts the weight bytes only (x and y
are up to ~6% of them at M = 128: llama3.2-1b's o projection). Per model and batch,
prints the predicted time of the projections of one decode step (x layers, + lm_head once).
--quick: llama2-7b at M = 64 with a ~20-setting grid (about 2 minutes on an H200).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tandem.bench.timing import ceilings
from tandem.bench.tune_gemv import ROTATE_BYTES, projections, time_rotating
from tandem.kernels import ops, reference
from tandem.kernels.skinny_gemm import MAX_M, _launch_skinny, tile_config

SMS, SMEM_BYTES = 132, 227 << 10  # H200
# (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k)
GRID = list(itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5), (1, 2, 4)))
QUICK_GRID = [c for c in itertools.product((64, 128), (64, 128), (4, 8), (3, 4), (1, 2, 4)) if (c[0] == 128) == (c[2] == 8)]


def settings(grid, M: int, rows: int, K: int, silu: bool) -> list[tuple]:
    """The grid less what cannot or need not run: tiles (and the peeled first tile, which stays
    allocated: kernels.skinny_tiles.tile_config) over the shared memory; weight tiles under 8 KB (too
    little in flight per stage); 8 warps on an accumulator small enough for 4; splits whose grid
    would exceed ~4 waves of one program per SM, or that would leave a split fewer tiles than
    stages."""
    block_m = max(16, 1 << (M - 1).bit_length())
    out_rows = rows // 2 if silu else rows
    kept = []
    for block_n, block_k, warps, stages, split in grid:
        stage_bytes = ((2 if silu else 1) * block_n + block_m) * block_k * 2
        programs = -(-out_rows // block_n)
        if (stages + 1) * stage_bytes > SMEM_BYTES or block_n * block_k * 2 < 8 << 10:
            continue
        if warps == 8 and block_n * block_m < 128 * 64:
            continue
        if split > 1 and (programs * split > 4 * SMS or K // block_k < split * stages):
            continue
        kept.append((block_n, block_k, warps, stages, split))
    return kept


def run_shape(proj, rows, K, silu, M, grid, copy_bw):
    nbytes = rows * K * 2
    copies = max(2, -(-ROTATE_BYTES // nbytes))
    weights = [(torch.randn(rows, K, device="cuda") / K**0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, rows // 2 if silu else rows, device="cuda", dtype=torch.bfloat16)
    ref = (reference.gemv_silu_mul if silu else reference.gemv)(x.float(), weights[0].float())
    if silu:
        cublas = time_rotating(lambda w: (lambda: ops.silu_mul(F.linear(x, w))), weights)
    else:
        cublas = time_rotating(lambda w: (lambda: F.linear(x, w)), weights)
    shape = f"{proj} {rows}x{K} M={M}"
    results = []
    for config in [None] + settings(grid, M, rows, K, silu):
        try:
            y.fill_(float("nan"))
            _launch_skinny(x, weights[0], None, y, silu, config)
            err = (y.float() - ref).abs().max().item()
            if not err <= 0.05 * ref.abs().max().item() + 1e-2:  # NaN fails too
                print(f"WRONG ANSWER {shape} {config or 'rule'}: max error {err}")
                results.append({"config": config, "rule": config is None, "error": f"WRONG ANSWER: max error {err}"})
                continue
            ms = time_rotating(lambda w: (lambda: _launch_skinny(x, w, None, y, silu, config)), weights)
            results.append({"config": config or tile_config(M, rows, K, silu), "rule": config is None, "ms": ms})
        except Exception as exc:  # a setting that does not compile (registers, shared memory)
            results.append({"config": config, "rule": config is None, "error": repr(exc)[:200]})
    del weights
    torch.cuda.empty_cache()
    ok = [r for r in results if "ms" in r]
    rule = next((r for r in ok if r["rule"]), None)
    best = min(ok, key=lambda r: r["ms"]) if ok else None

    def of_copy_bw(ms):
        return nbytes / (ms / 1e3) / copy_bw if ms else None

    return {"proj": proj, "rows": rows, "K": K, "silu_mul": silu, "M": M, "bytes": nbytes, "cublas_ms": cublas,
            "rule_ms": rule and rule["ms"], "best_ms": best and best["ms"], "best_config": best and best["config"],
            "cublas_of_copy_bw": of_copy_bw(cublas), "rule_of_copy_bw": of_copy_bw(rule and rule["ms"]),
            "best_of_copy_bw": of_copy_bw(best and best["ms"]), "settings": len(results), "sweep": results}


def _pct(value) -> str:
    return f"{value:>8.1%}" if value is not None else f"{'-':>8}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama2-7b,llama3-8b,llama3.2-1b")
    parser.add_argument("--batches", default="64,128", help="decode batches M, each 2..128 (8,16,32,64,128)")
    parser.add_argument("--quick", action="store_true", help="llama2-7b, M = 64, a ~20-setting grid")
    parser.add_argument("--out", default="tune_skinny_gemm.json")
    args = parser.parse_args()
    models, grid = args.models.split(","), GRID
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        models, batches, grid = ["llama2-7b"], [64], QUICK_GRID
    assert all(1 <= M <= MAX_M for M in batches), f"batches must be 1..{MAX_M}"
    copy_bw = ceilings()["hbm_copy_TBps"] * 1e12
    report, seen = {"copy_TBps": copy_bw / 1e12, "quick": args.quick, "shapes": [], "models": {}}, {}
    print(f"{'shape':<30}{'cuBLAS':>8}{'rule':>8}{'best':>8}  (% of copy bandwidth)  best config, settings")
    for name in models:
        for M in batches:
            step = {"cublas_ms": 0.0, "rule_ms": 0.0, "best_ms": 0.0}
            for proj, rows, K, silu, count in projections(name):
                key = (rows, K, silu, M)
                if key not in seen:
                    seen[key] = r = run_shape(proj, rows, K, silu, M, grid, copy_bw)
                    report["shapes"].append(r)
                    print(f"{proj + f' {rows}x{K} M={M}':<30}{_pct(r['cublas_of_copy_bw'])}{_pct(r['rule_of_copy_bw'])}"
                          f"{_pct(r['best_of_copy_bw'])}  {r['best_config']}, {r['settings']}", flush=True)
                for k in step:  # a shape with no working setting counts at cuBLAS's time
                    step[k] += (seen[key][k] or seen[key]["cublas_ms"]) * count
            report["models"].setdefault(name, {})[M] = step
            c = step["cublas_ms"]
            print(f"== {name} M={M}: projections per step (lm_head included): cuBLAS {c:.3f} ms, "
                  f"rule {step['rule_ms']:.3f} ms ({step['rule_ms'] / c - 1:+.1%}), "
                  f"best {step['best_ms']:.3f} ms ({step['best_ms'] / c - 1:+.1%})")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
