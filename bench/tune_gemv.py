"""The one-token GEMV kernels against cuBLAS at the benchmark shapes (GPU), with a tile sweep.

    python3 -m tandem.bench.tune_gemv --out $OUT/tune_gemv.json [--models llama2-7b,llama3-8b,llama3.2-1b]

For every projection of a decode step at batch 1 (qkv, o, gate_up with its
SiLU·mul, down, lm_head), times torch's F.linear (cuBLAS; + the SiLU·mul
kernel for gate_up), the Triton GEMV with the shape rule, and every setting of
a small grid; each is checked against the fp32 reference. Each timing is one CUDA
graph cycling over enough copies of the weight to leave the L2 cache cold, as
the layers of a real step do. Prints per shape the bandwidth reached, then per
model the predicted change of one decode step (projections x layers + lm_head).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tandem.bench.shapes import SHAPES
from tandem.bench.timing import ceilings, graph_ms
from tandem.kernels import ops, reference
from tandem.kernels.gemv import _launch_gemv, tile_config

ROTATE_BYTES = 512 << 20  # weights cycled per timing: far beyond the 50 MB L2
GRID = list(itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2, 4)))


def projections(name: str) -> list[tuple[str, int, int, bool, int]]:
    """(projection, rows, K, silu_mul, count per step) of one decode step."""
    s = SHAPES[name]
    h, inter, heads, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    d, layers = h // heads, s["num_hidden_layers"]
    return [("qkv", (heads + 2 * kv) * d, h, False, layers), ("o", h, h, False, layers),
            ("gate_up", 2 * inter, h, True, layers), ("down", h, inter, False, layers),
            ("lm_head", s["vocab_size"], h, False, 1)]


def time_rotating(fn_for, weights) -> float:
    """ms per call of fn_for(w), cycling over ``weights``, replayed as one CUDA graph (a Python
    launch takes longer than a small GEMV: launched one by one, the launches would be timed)."""
    return graph_ms([fn_for(w) for w in weights])


def run_shape(proj, rows, K, silu, copy_bw):
    nbytes = rows * K * 2
    copies = max(2, -(-ROTATE_BYTES // nbytes))
    weights = [(torch.randn(rows, K, device="cuda") / K**0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(K, device="cuda", dtype=torch.bfloat16)
    out_rows = rows // 2 if silu else rows
    y = torch.empty(out_rows, device="cuda", dtype=torch.bfloat16)
    ref_fn = reference.gemv_silu_mul if silu else reference.gemv
    ref = ref_fn(x.float(), weights[0].float())
    x2 = x.view(1, K)
    if silu:
        cublas = time_rotating(lambda w: (lambda: ops.silu_mul(F.linear(x2, w))), weights)
    else:
        cublas = time_rotating(lambda w: (lambda: F.linear(x2, w)), weights)
    results = []
    for config in [None] + GRID:
        if silu and config is not None and config[0] > 8:
            continue
        try:
            y.fill_(float("nan"))
            _launch_gemv(x, weights[0], None, y, silu, config)
            err = (y.float() - ref).abs().max().item()
            if not err <= 0.05 * ref.abs().max().item() + 1e-2:
                results.append({"config": config, "error": f"max error {err}"})
                continue
            ms = time_rotating(lambda w: (lambda: _launch_gemv(x, w, None, y, silu, config)), weights)
            results.append({"config": config or tile_config(out_rows, K, silu), "rule": config is None, "ms": ms})
        except Exception as exc:  # a setting that does not compile (registers, shared memory)
            results.append({"config": config, "error": repr(exc)[:200]})
    ok = [r for r in results if "ms" in r]
    best = min(ok, key=lambda r: r["ms"])
    rule = next(r for r in ok if r.get("rule"))
    del weights
    torch.cuda.empty_cache()
    return {"proj": proj, "rows": rows, "K": K, "silu_mul": silu, "bytes": nbytes, "cublas_ms": cublas,
            "rule_ms": rule["ms"], "best_ms": best["ms"], "best_config": best["config"],
            "cublas_of_copy_bw": nbytes / (cublas / 1e3) / copy_bw,
            "rule_of_copy_bw": nbytes / (rule["ms"] / 1e3) / copy_bw,
            "best_of_copy_bw": nbytes / (best["ms"] / 1e3) / copy_bw, "sweep": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="llama2-7b,llama3-8b,llama3.2-1b")
    parser.add_argument("--out", default="tune_gemv.json")
    args = parser.parse_args()
    copy_bw = ceilings()["hbm_copy_TBps"] * 1e12
    report, seen = {"copy_TBps": copy_bw / 1e12, "shapes": [], "models": {}}, {}
    print(f"{'shape':<28}{'cuBLAS':>9}{'rule':>9}{'best':>9}  (% of copy bandwidth)  best config")
    for name in args.models.split(","):
        step = {"cublas_ms": 0.0, "rule_ms": 0.0, "best_ms": 0.0}
        for proj, rows, K, silu, count in projections(name):
            key = (rows, K, silu)
            if key not in seen:
                seen[key] = run_shape(proj, rows, K, silu, copy_bw)
                r = seen[key]
                report["shapes"].append(r)
                print(f"{proj + f' {rows}x{K}':<28}{r['cublas_of_copy_bw']:>8.1%}{r['rule_of_copy_bw']:>9.1%}"
                      f"{r['best_of_copy_bw']:>9.1%}  {r['best_config']}")
            for k in step:
                step[k] += seen[key][k] * count
        report["models"][name] = step
        print(f"== {name}: projections per step: cuBLAS {step['cublas_ms']:.3f} ms, rule {step['rule_ms']:.3f} ms, "
              f"best {step['best_ms']:.3f} ms")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
