"""The FP8 kernels against their bf16 counterparts at one model's decode and prefill shapes (GPU).

    python3 -m tandem.bench.tune_fp8 [--model llama3-8b] [--parts gemv,skinny,prefill,attention]
                                     [--out $OUT/tune_fp8.json]

Per projection of a step (qkv, o, gate_up with its SiLU·mul, down; lm_head stays in the model's
dtype) and per batch:
  gemv (1 token):      bf16 GEMV (its rule, and with PREFETCH), FP8 GEMV with its rule and a tile
                       grid, each tile plain, with PREFETCH and with F16_PRODUCTS;
  skinny (16, 64):     bf16 cuBLAS and skinny GEMM; FP8 weight-only skinny GEMM (weights widened in
                       registers), FP8 tensor-core skinny GEMM (x quantized per token first, the
                       quantization timed with it), and torch's scaled matmul (with the
                       quantization, and alone), each FP8 form with its rule and a tile grid;
  prefill (2048):      bf16 cuBLAS against the quantization plus torch's scaled matmul;
  attention:           decode attention over a bf16 and an FP8 cache (``--attention-cases``, batch x
                       tokens; default 64 x 256 and 8 x 2048), the FP8 one with its rule and a tile
                       grid, each tile with and without V_DEQUANT (V widened with its scale in the
                       tile), or with ``--attention-ids`` (wide grids: every KV head of a batch of
                       7B's 32 is a program) V_DEQUANT with the block ids per tile and in registers,
                       the products in bf16 and in fp16 (F16_DOT), on a smaller tile grid.
Every setting is checked against the fp32 reference of its own numbers before it is timed
(a wrong one is recorded, not timed). Timings as bench.tune_gemv's: one CUDA graph cycling
over enough weight copies to leave the L2 cold. Prints per part the best setting and the
predicted time of one step's projections (x layers), bf16 against FP8.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tandem.bench.shapes import SHAPES
from tandem.bench.timing import ceilings, graph_ms
from tandem.bench.tune_gemv import ROTATE_BYTES, projections, time_rotating
from tandem.kernels import decode_attention, decode_config, fp8_matmul, ops, reference
from tandem.kernels.decode_attention import _launch_decode_attention
from tandem.kernels.fp8_quant import quantize_rows_fp8
from tandem.kernels.fp8_weight import dequantize, quantize_weight
from tandem.kernels.gemv import _launch_gemv
from tandem.kernels.gemv import tile_config as gemv_rule
from tandem.kernels.skinny_gemm import _launch_skinny
from tandem.kernels.skinny_gemm import tile_config as skinny_rule

DEVICE = "cuda"
SMEM_BYTES = 227 << 10  # sm90
# (BLOCK_N, BLOCK_K, num_warps, num_stages, prefetch, f16 products)
GEMV_GRID = [(*t, prefetch, f16) for t in itertools.product((4, 8, 16), (512, 1024, 2048, 4096), (4, 8), (2,))
             for prefetch, f16 in ((False, False), (True, False), (False, True))]
# (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k)
SKINNY_GRID = [c for c in itertools.product((64, 128), (128, 256), (4, 8), (3, 5), (1, 2, 4))
               if (c[0] == 128) == (c[2] == 8)]
ATTENTION_TILES = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))
ATTENTION_CASES = "64:256,8:2048"
# (V_DEQUANT, block ids in registers (None: the rule's), F16_DOT) per tile
ATTENTION_FORMS = ((False, None, False), (True, None, False))
# --attention-ids: V_DEQUANT, ids per tile and in registers, products in bf16 and fp16, on fewer tiles
ATTENTION_ID_FORMS = tuple((True, ids, f16) for f16 in (False, True) for ids in (False, True))
ATTENTION_ID_TILES = list(itertools.product((32, 64, 128), (2, 4), (2, 3)))
# --attention-prefetch: the register-prefetch form's tiles (its loads are not Triton's pipeline: 1 stage)
ATTENTION_PREFETCH_TILES = list(itertools.product((16, 32, 64), (2, 4), (1,)))
# --attention-fp8-scores: the scores from an E4M3 product (FP8_QK; sm90's wgmma wants 64 keys a tile
# and warps in fours), V widened by its scale in fp16, block ids per tile and in registers
ATTENTION_FP8_QK_TILES = list(itertools.product((64, 128), (4, 8), (2, 3)))


def _weights(rows: int, K: int) -> list[torch.Tensor]:
    copies = max(2, -(-ROTATE_BYTES // (rows * K * 2)))
    return [(torch.randn(rows, K, device=DEVICE) / K**0.5).to(torch.bfloat16) for _ in range(copies)]


def _close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    err = (y.float() - ref).abs().max().item()
    return err <= 0.02 * ref.abs().max().item() + 1e-2  # NaN fails too


def _sweep(configs, launch, check, rotate) -> list[dict]:
    """[{config, ms} | {config, error}]: each config checked by ``check(config)`` and timed by
    ``rotate(lambda w: lambda: launch(w, config))``; None is the rule."""
    out = []
    for config in configs:
        try:
            if not check(config):
                out.append({"config": config, "error": "WRONG ANSWER"})
                print(f"  WRONG ANSWER {config}", flush=True)
                continue
            out.append({"config": config, "ms": rotate(lambda w, c=config: (lambda: launch(w, c)))})
        except Exception as exc:  # a setting that does not compile (registers, shared memory)
            out.append({"config": config, "error": repr(exc)[:160]})
    return out


def _best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "ms" in r]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def _rule(rows: list[dict]) -> float | None:
    return next((r["ms"] for r in rows if r["config"] is None and "ms" in r), None)


def _skinny_settings(M: int, rows: int, K: int, silu: bool, w_bytes: int, x_bytes: int) -> list[tuple]:
    block_m = max(16, 1 << (M - 1).bit_length())
    out_rows = rows // 2 if silu else rows
    kept = []
    for block_n, block_k, warps, stages, split in SKINNY_GRID:
        stage = ((2 if silu else 1) * block_n * w_bytes + block_m * x_bytes) * block_k
        if silu and w_bytes == 1 and x_bytes == 2:  # the widened tiles too
            stage += 2 * block_n * block_k * 2
        if (stages + 1) * stage > SMEM_BYTES:
            continue
        if split > 1 and (-(-out_rows // block_n) * split > 4 * 132 or K // block_k < split * stages):
            continue
        kept.append((block_n, block_k, warps, stages, split))
    return kept


def gemv_part(model: str, copy_bw: float) -> dict:
    report, step = [], {"bf16_ms": 0.0, "fp8_rule_ms": 0.0, "fp8_best_ms": 0.0}
    for proj, rows, K, silu, count in projections(model)[:4]:
        weights = _weights(rows, K)
        fp8 = [quantize_weight(w) for w in weights]
        x = torch.randn(K, device=DEVICE, dtype=torch.bfloat16)
        y = torch.empty(rows // 2 if silu else rows, device=DEVICE, dtype=torch.bfloat16)
        ref = (reference.gemv_silu_mul if silu else reference.gemv)(x.float(), dequantize(fp8[0]))

        def launch(w, config):
            _launch_gemv(x, w, None, y, silu, config)

        def check(config):
            y.fill_(float("nan"))
            launch(fp8[0], config)
            return _close(y, ref)

        bf16 = time_rotating(lambda w: (lambda: _launch_gemv(x, w, None, y, silu)), weights)
        out_rows = rows // 2 if silu else rows
        bf16_rule = gemv_rule(out_rows, K, silu)
        bf16_prefetch = time_rotating(lambda w: (lambda: _launch_gemv(x, w, None, y, silu, (*bf16_rule, True))),
                                      weights)
        sweep = _sweep([None] + [c for c in GEMV_GRID if not (silu and c[0] > 8)], launch, check,
                       lambda fn: time_rotating(fn, fp8))
        best, rule = _best(sweep), _rule(sweep)
        fp8_bytes = rows * K
        r = {"proj": proj, "rows": rows, "K": K, "bf16_ms": bf16, "bf16_prefetch_ms": bf16_prefetch,
             "fp8_rule_ms": rule, "fp8_best_ms": best["ms"],
             "fp8_rule_config": gemv_rule(out_rows, K, silu, fp8=True), "fp8_best_config": best["config"],
             "bf16_of_copy_bw": 2 * fp8_bytes / (bf16 / 1e3) / copy_bw,
             "fp8_rule_of_copy_bw": fp8_bytes / (rule / 1e3) / copy_bw,
             "fp8_best_of_copy_bw": fp8_bytes / (best["ms"] / 1e3) / copy_bw, "sweep": sweep}
        report.append(r)
        for k in step:
            step[k] += r[k] * count
        print(f"gemv {proj:8s} {rows}x{K}: bf16 {r['bf16_of_copy_bw']:.1%} "
              f"(prefetched {bf16 / bf16_prefetch * r['bf16_of_copy_bw']:.1%})  "
              f"fp8 rule {r['fp8_rule_of_copy_bw']:.1%}  "
              f"best {r['fp8_best_of_copy_bw']:.1%} {best['config']}", flush=True)
        torch.cuda.empty_cache()
    print(f"== gemv {model}: projections per step bf16 {step['bf16_ms']:.3f} ms, fp8 rule {step['fp8_rule_ms']:.3f}, "
          f"fp8 best {step['fp8_best_ms']:.3f}", flush=True)
    return {"shapes": report, "step": step}


def skinny_part(model: str, batches: list[int], copy_bw: float) -> dict:
    report, steps = [], {}
    for M in batches:
        step = steps.setdefault(M, {})
        for proj, rows, K, silu, count in projections(model)[:4]:
            weights = _weights(rows, K)
            fp8 = [quantize_weight(w) for w in weights]
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            out_rows = rows // 2 if silu else rows
            y = torch.empty(M, out_rows, device=DEVICE, dtype=torch.bfloat16)
            fn_ref = reference.gemv_silu_mul if silu else reference.gemv
            ref_w = fn_ref(x.float(), dequantize(fp8[0]))
            x_q, x_s = quantize_rows_fp8(x)
            ref_wx = fn_ref(x_q.float() * x_s, dequantize(fp8[0]))
            r = {"proj": proj, "rows": rows, "K": K, "M": M}

            def cublas(w):
                return (lambda: ops.silu_mul(F.linear(x, w))) if silu else (lambda: F.linear(x, w))

            r["bf16_cublas_ms"] = time_rotating(cublas, weights)
            r["bf16_skinny_ms"] = time_rotating(lambda w: (lambda: _launch_skinny(x, w, None, y, silu)), weights)

            def weight_only(w, config):
                _launch_skinny(x, w, None, y, silu, config)

            def tensor_core(w, config):
                q, s = quantize_rows_fp8(x)
                _launch_skinny(q, w, None, y, silu, config, x_scale=s)

            def checker(launch, ref):
                def check(config):
                    y.fill_(float("nan"))
                    launch(fp8[0], config)
                    return _close(y, ref)
                return check

            def rotate(fn):
                return time_rotating(fn, fp8)

            for name, launch, ref, x_bytes in (("weight_only", weight_only, ref_w, 2),
                                               ("tensor_core", tensor_core, ref_wx, 1)):
                sweep = _sweep([None] + _skinny_settings(M, rows, K, silu, 1, x_bytes), launch,
                               checker(launch, ref), rotate)
                best = _best(sweep)
                r[f"{name}_rule_ms"], r[f"{name}_best_ms"] = _rule(sweep), best and best["ms"]
                r[f"{name}_best_config"], r[f"{name}_sweep"] = best and best["config"], sweep
                r[f"{name}_rule_config"] = skinny_rule(M, rows, K, silu, x_bytes)

            def scaled(w, quantize=True):
                def fn():
                    q, s = quantize_rows_fp8(x) if quantize else (x_q, x_s)
                    out = fp8_matmul.scaled_mm(q, s, w, None, torch.bfloat16)
                    return ops.silu_mul(out) if silu else out
                return fn

            r["scaled_mm_ms"] = rotate(scaled)
            r["scaled_mm_alone_ms"] = rotate(lambda w: scaled(w, quantize=False))
            r["quantize_ms"] = graph_ms([lambda: quantize_rows_fp8(x)] * 20)
            r["fp8_best_ms"] = min(ms for ms in (r["weight_only_best_ms"], r["tensor_core_best_ms"], r["scaled_mm_ms"])
                                   if ms)
            r["fp8_bytes_of_copy_bw"] = rows * K / (r["fp8_best_ms"] / 1e3) / copy_bw
            report.append(r)
            for k in ("bf16_cublas_ms", "bf16_skinny_ms", "weight_only_rule_ms", "weight_only_best_ms",
                      "tensor_core_rule_ms", "tensor_core_best_ms", "scaled_mm_ms", "fp8_best_ms"):
                step[k] = step.get(k, 0.0) + (r[k] or float("inf")) * count
            us = {k: r[k] * 1e3 if r[k] else float("nan") for k in r if k.endswith("_ms")}
            print(f"skinny {proj:8s} M={M:<3d}: bf16 cuBLAS {us['bf16_cublas_ms']:.1f} skinny {us['bf16_skinny_ms']:.1f} | "
                  f"fp8 w-only rule {us['weight_only_rule_ms']:.1f} best {us['weight_only_best_ms']:.1f} "
                  f"{r['weight_only_best_config']} | tc rule {us['tensor_core_rule_ms']:.1f} best "
                  f"{us['tensor_core_best_ms']:.1f} {r['tensor_core_best_config']} | scaled_mm {us['scaled_mm_ms']:.1f} "
                  f"(alone {us['scaled_mm_alone_ms']:.1f}, quantize {us['quantize_ms']:.1f}) us", flush=True)
            torch.cuda.empty_cache()
        print(f"== skinny {model} M={M}: per step (ms) " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in step.items()),
              flush=True)
    return {"shapes": report, "steps": steps}


def prefill_part(model: str, M: int = 2048) -> dict:
    report, step = [], {"bf16_ms": 0.0, "fp8_ms": 0.0, "fp8_matmul_only_ms": 0.0}
    for proj, rows, K, silu, count in projections(model)[:4]:
        w = (torch.randn(rows, K, device=DEVICE) / K**0.5).to(torch.bfloat16)
        fw = quantize_weight(w)
        x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
        q, s = quantize_rows_fp8(x)
        bf16 = graph_ms([lambda: F.linear(x, w)] * 5)
        fp8 = graph_ms([lambda: fp8_matmul.scaled_mm(*quantize_rows_fp8(x), fw, None, torch.bfloat16)] * 5)
        alone = graph_ms([lambda: fp8_matmul.scaled_mm(q, s, fw, None, torch.bfloat16)] * 5)
        flops = 2 * M * rows * K
        r = {"proj": proj, "rows": rows, "K": K, "M": M, "bf16_ms": bf16, "fp8_ms": fp8, "fp8_matmul_only_ms": alone,
             "bf16_TFLOPs": flops / bf16 / 1e9, "fp8_TFLOPs": flops / fp8 / 1e9, "fp8_matmul_TFLOPs": flops / alone / 1e9}
        report.append(r)
        for k in step:
            step[k] += r[k] * count
        print(f"prefill {proj:8s} M={M}: bf16 {bf16 * 1e3:.0f} us ({r['bf16_TFLOPs']:.0f} TFLOP/s), fp8 {fp8 * 1e3:.0f} us "
              f"({r['fp8_TFLOPs']:.0f}), matmul alone {alone * 1e3:.0f} us ({r['fp8_matmul_TFLOPs']:.0f})", flush=True)
        torch.cuda.empty_cache()
    print(f"== prefill {model} M={M}: projections bf16 {step['bf16_ms']:.2f} ms, fp8 {step['fp8_ms']:.2f} ms "
          f"(matmuls alone {step['fp8_matmul_only_ms']:.2f})", flush=True)
    return {"shapes": report, "step": step}


def attention_part(model: str, copy_bw: float, cases: str = ATTENTION_CASES, forms: tuple = ATTENTION_FORMS,
                   tiles: list = ATTENTION_TILES, reg_prefetch: bool = False, fp8_scores: bool = False) -> list[dict]:
    """``reg_prefetch``: also each tile of ATTENTION_PREFETCH_TILES in the rule's form (V widened,
    fp16 products), block ids per tile and in registers, with the next tile loaded into registers
    before a tile's math (decode_kernels' REG_PREFETCH). ``fp8_scores``: also each tile of
    ATTENTION_FP8_QK_TILES with the scores from an E4M3 product (FP8_QK), checked against the
    reference with q quantized as the form does (reference.fp8_query)."""
    s = SHAPES[model]
    hq, hkv = s["num_attention_heads"], s["num_key_value_heads"]
    d, block_size = s["hidden_size"] // hq, 16
    results = []
    for batch, context in (tuple(int(n) for n in case.split(":")) for case in cases.split(",")):
        blocks = batch * (-(-context // block_size))
        k = torch.randn(blocks + 8, block_size, hkv, d, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k_scale = (k.float().abs().amax(dim=(0, 1, 3)) / 448).contiguous()
        v_scale = (v.float().abs().amax(dim=(0, 1, 3)) / 448).contiguous()
        k8, v8 = reference.quantize_kv_fp8(k, k_scale), reference.quantize_kv_fp8(v, v_scale)
        q = torch.randn(batch, hq, d, device=DEVICE, dtype=torch.bfloat16)
        tables = torch.randperm(blocks, device=DEVICE)[:blocks].to(torch.int32).view(batch, -1).contiguous()
        lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        scale = d**-0.5
        out = torch.empty_like(q)
        ref = reference.decode_attention(q.float(), reference.dequantize_kv_fp8(k8, k_scale),
                                         reference.dequantize_kv_fp8(v8, v_scale), tables, lens, scale)
        ref_fp8_q = reference.decode_attention(reference.fp8_query(q), reference.dequantize_kv_fp8(k8, k_scale),
                                               reference.dequantize_kv_fp8(v8, v_scale), tables, lens, scale)
        splits = decode_config.num_kv_splits(batch, hkv, tables.shape[1] * block_size, q.device)

        def run(config, kc=k8, vc=v8, ks=k_scale, vs=v_scale, ids=None, prefetch=False):
            def call():
                _launch_decode_attention(q, kc, vc, tables, lens, out, scale, None, None, config,
                                         k_scale=ks, v_scale=vs, ids_in_registers=ids,  # ids None: the rule's
                                         reg_prefetch=prefetch)
            return call

        bf16 = graph_ms([run(None, k, v, None, None)] * 10)
        rows = []
        settings = [(None, None, False)] + [(t + (splits, True, v_dequant, f16), ids, False)
                                            for v_dequant, ids, f16 in forms for t in tiles]
        if reg_prefetch:
            settings += [(t + (splits, True, True, True), ids, True) for ids in (False, True)
                         for t in ATTENTION_PREFETCH_TILES]
        if fp8_scores:
            settings += [(t + (splits, True, True, True, True), ids, False) for ids in (False, True)
                         for t in ATTENTION_FP8_QK_TILES]
        for config, ids, prefetch in settings:
            try:
                out.fill_(float("nan"))
                run(config, ids=ids, prefetch=prefetch)()
                fp8_qk = (config[7] if config is not None and len(config) > 7 else config is None and
                          decode_attention.launch_plan(batch, tables.shape[1], q.dtype, k8).fp8_qk)
                if not torch.allclose(out.float(), ref_fp8_q if fp8_qk else ref, atol=2e-2, rtol=2e-2):
                    rows.append({"config": config, "reg_prefetch": prefetch, "error": "WRONG ANSWER"})
                    continue
                rows.append({"config": config, "ids_in_registers": ids, "reg_prefetch": prefetch,
                             "ms": graph_ms([run(config, ids=ids, prefetch=prefetch)] * 10)})
            except Exception as exc:
                rows.append({"config": config, "ids_in_registers": ids, "reg_prefetch": prefetch,
                             "error": repr(exc)[:160]})
        best, rule = _best(rows), _rule(rows)
        by_products = {name: _best([r for r in rows if r["config"] is not None and bool(r["config"][6]) == f16
                                    and len(r["config"]) == 7])
                       for name, f16 in (("bf16", False), ("f16", True))}
        by_products["fp8_scores"] = _best([r for r in rows if r["config"] is not None and len(r["config"]) > 7])
        bf16_bytes = 2 * batch * context * hkv * d * 2
        r = {"batch": batch, "context": context, "splits": splits, "bf16_us": bf16 * 1e3, "fp8_rule_us": rule * 1e3,
             "fp8_best_us": best["ms"] * 1e3, "fp8_best_config": best["config"],
             "fp8_best_ids_in_registers": best["ids_in_registers"], "fp8_best_reg_prefetch": best["reg_prefetch"],
             **{f"fp8_best_{name}_products_us": b["ms"] * 1e3 for name, b in by_products.items() if b},
             "bf16_of_copy_bw": bf16_bytes / (bf16 / 1e3) / copy_bw,
             "fp8_rule_of_copy_bw": bf16_bytes / 2 / (rule / 1e3) / copy_bw,
             "fp8_best_of_copy_bw": bf16_bytes / 2 / (best["ms"] / 1e3) / copy_bw, "sweep": rows}
        results.append(r)
        print(f"attention b{batch} ctx{context}: bf16 {r['bf16_us']:.1f} us ({r['bf16_of_copy_bw']:.0%}), fp8 rule "
              f"{r['fp8_rule_us']:.1f} ({r['fp8_rule_of_copy_bw']:.0%}), best {r['fp8_best_us']:.1f} "
              f"({r['fp8_best_of_copy_bw']:.0%}) {best['config']} ids in registers {best['ids_in_registers']} register "
              f"prefetch {best['reg_prefetch']}; best with "
              f"bf16 / f16 products / fp8 scores {r.get('fp8_best_bf16_products_us', 0):.1f} / "
              f"{r.get('fp8_best_f16_products_us', 0):.1f} / {r.get('fp8_best_fp8_scores_products_us', 0):.1f}",
              flush=True)
        torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--parts", default="gemv,skinny,prefill,attention")
    parser.add_argument("--batches", default="16,64", help="the skinny part's decode batches")
    parser.add_argument("--attention-cases", default=ATTENTION_CASES, help="the attention part's B:TOKENS,...")
    parser.add_argument("--attention-ids", action="store_true",
                        help="the attention grid with V_DEQUANT, block ids per tile and in registers, "
                             "products in bf16 and in fp16 (F16_DOT)")
    parser.add_argument("--attention-prefetch", action="store_true",
                        help="also the attention's register-prefetch form (the next tile loaded before a tile's math)")
    parser.add_argument("--attention-fp8-scores", action="store_true",
                        help="also the attention's scores from an E4M3 product (FP8_QK: q quantized per head)")
    parser.add_argument("--out", default="tune_fp8.json")
    args = parser.parse_args()
    copy_bw = ceilings()["hbm_copy_TBps"] * 1e12
    report = {"model": args.model, "copy_TBps": copy_bw / 1e12}
    parts = args.parts.split(",")

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    with torch.inference_mode():
        if "gemv" in parts:
            report["gemv"] = gemv_part(args.model, copy_bw)
            save()
        if "attention" in parts:
            forms, tiles = ((ATTENTION_ID_FORMS, ATTENTION_ID_TILES) if args.attention_ids
                            else (ATTENTION_FORMS, ATTENTION_TILES))
            report["attention"] = attention_part(args.model, copy_bw, args.attention_cases, forms, tiles,
                                                 args.attention_prefetch, args.attention_fp8_scores)
            save()
        if "prefill" in parts:
            report["prefill"] = prefill_part(args.model)
            save()
        if "skinny" in parts:
            report["skinny"] = skinny_part(args.model, [int(b) for b in args.batches.split(",")], copy_bw)
            save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
