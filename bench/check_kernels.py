"""Check and time tandem's Triton kernels on a GPU at real model shapes.

    python3 -m tandem.bench.check_kernels --out kernels.json [--quick] [--sweep]

For llama2-7b (32 q / 32 kv heads) and llama3-8b (32 q / 8 kv heads), head_dim
128, block size 16, bf16: every kernel is compared with its torch reference
run in fp32 on the same inputs, and timed (median of triton.testing.do_bench)
against the reference in bf16 and, for attention where shapes allow (equal
lengths, no cached context), torch's scaled_dot_product_attention on dense KV.
Decode attention also reports the achieved bandwidth: bytes of K and V that
must be read over its time. Prints a table; writes one JSON row per case to --out.
--sweep also times decode at fixed split counts and prefill at other tile shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from tandem.kernels import decode_attention as decode_module
from tandem.kernels import decode_config
from tandem.kernels import prefill_attention as prefill_module
from tandem.kernels import reference
from tandem.kernels.activation import silu_mul
from tandem.kernels.block_copy import gather_blocks, scatter_blocks
from tandem.kernels.penalties import apply_penalties
from tandem.kernels.decode_attention import DecodeWorkspace, decode_attention
from tandem.kernels.lora import lora_add, lora_expand, lora_shrink
from tandem.kernels.prefill_attention import prefill_attention
from tandem.kernels.rms_norm import fused_add_rms_norm
from tandem.kernels.rotary import rotary_kv_write

MODELS = {"llama2-7b": (32, 32), "llama3-8b": (32, 8)}  # name -> (num_q_heads, num_kv_heads)
HEAD_DIM, BLOCK_SIZE, DTYPE = 128, 16, torch.bfloat16
BF16_ATOL = 3e-2  # of |out - ref| against an fp32 reference, on O(1) outputs

rows: list[dict] = []


def on_cuda(fn):
    """kernels/reference.py builds attention masks with torch.arange on the default
    device, so on CUDA tensors its attention runs only with CUDA as the default."""
    def wrapped(*args):
        with torch.device("cuda"):
            return fn(*args)
    return wrapped


ref_prefill = on_cuda(reference.prefill_attention)
ref_decode = on_cuda(reference.decode_attention)


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.float(), ref.float()
    finite = bool(torch.isfinite(out).all())
    max_abs = (out - ref).abs().max().item() if out.numel() else 0.0
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item() if out.numel() else 0.0
    return {"max_abs_err": max_abs, "rel_err": rel, "ok": finite and max_abs <= BF16_ATOL * max(1.0, ref.abs().max().item())}


def record(kernel: str, shape: str, err: dict, triton_ms: float, reference_ms: float | None, **extra) -> None:
    row = {"kernel": kernel, "shape": shape, **err, "triton_ms": triton_ms, "reference_ms": reference_ms, **extra}
    rows.append(row)
    speedup = f"{reference_ms / triton_ms:7.1f}x" if reference_ms else "      -"
    sdpa = f"{extra['sdpa_ms']:8.3f}" if extra.get("sdpa_ms") else "       -"
    bw = f"{extra['gbps']:7.0f}" if extra.get("gbps") else "      -"
    print(f"{kernel:18s} {shape:44s} {'ok ' if err.get('ok', True) else 'BAD'} {err.get('rel_err', 0):8.1e} "
          f"{triton_ms:8.3f} {reference_ms or 0:9.3f} {speedup} {sdpa} {bw}", flush=True)


def paged_kv(seq_lens: list[int], num_kv_heads: int, spare: int = 16):
    """Random bf16 K/V in shuffled blocks. -> k_cache, v_cache, block_tables [B, max_blocks] int32."""
    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + spare
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda").int()
    width = max(blocks)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(blocks):
        block_tables[b, :n] = perm[used:used + n]
        used += n
    return k_cache, v_cache, block_tables


def dense_kv(cache, block_tables, seq_len):
    """[B, H, seq_len, D] for SDPA (all sequences of length seq_len)."""
    per_seq = [reference._gather_seq_kv(cache, block_tables[b], seq_len) for b in range(block_tables.shape[0])]
    return torch.stack(per_seq).transpose(1, 2).contiguous()


def check_elementwise() -> None:
    for tokens in (1, 64, 4096):
        x, r = (torch.randn(tokens, 4096, device="cuda", dtype=DTYPE) for _ in range(2))
        w = torch.randn(4096, device="cuda", dtype=DTYPE)
        out, new_r = fused_add_rms_norm(x, r, w, 1e-5)
        ref, _ = reference.fused_add_rms_norm(x.float(), r.float(), w.float(), 1e-5)
        err = errors(out, ref)
        err["ok"] &= torch.equal(new_r, x + r)
        record("fused_add_rms_norm", f"T={tokens} hidden=4096", err,
               bench_ms(lambda: fused_add_rms_norm(x, r, w, 1e-5)),
               bench_ms(lambda: reference.fused_add_rms_norm(x, r, w, 1e-5)))
    for tokens in (1, 64, 4096):
        x = torch.randn(tokens, 2 * 14336, device="cuda", dtype=DTYPE)
        record("silu_mul", f"T={tokens} inter=14336", errors(silu_mul(x), reference.silu_mul(x.float())),
               bench_ms(lambda: silu_mul(x)), bench_ms(lambda: reference.silu_mul(x)))
    for num_rows in (8, 64):  # decode rows with penalties, Llama 3's vocabulary (in place: timed on a copy)
        vocab = 128256
        logits = torch.randn(64, vocab, device="cuda") * 4
        counts = torch.randint(0, 3, (80, vocab), device="cuda").float()
        prompt = torch.rand(80, vocab, device="cuda") < 0.01
        index = torch.randperm(64, device="cuda")[:num_rows], torch.randperm(80, device="cuda")[:num_rows]
        params = torch.tensor([[1.1, 0.2, 0.1]], device="cuda").repeat(num_rows, 1)
        out, ref = logits.clone(), logits.clone()
        apply_penalties(out, *index, counts, prompt, params)
        reference.apply_penalties(ref, *index, counts, prompt, params)
        record("apply_penalties", f"rows={num_rows} of 64 vocab={vocab}", errors(out, ref),
               bench_ms(lambda: apply_penalties(logits.clone(), *index, counts, prompt, params)),
               bench_ms(lambda: reference.apply_penalties(logits.clone(), *index, counts, prompt, params)))
    for model, (hq, hk) in MODELS.items():
        for tokens in (1, 64, 4096):
            qkv = torch.randn(tokens, (hq + 2 * hk) * HEAD_DIM, device="cuda", dtype=DTYPE)
            q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in qkv.split([hq * HEAD_DIM, hk * HEAD_DIM, hk * HEAD_DIM], -1))
            positions = torch.randint(0, 8192, (tokens,), device="cuda")
            cos_sin = torch.randn(8192, HEAD_DIM, device="cuda")
            num_blocks = math.ceil(tokens / BLOCK_SIZE) + 4
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
            kc = torch.zeros(num_blocks, BLOCK_SIZE, hk, HEAD_DIM, device="cuda", dtype=DTYPE)
            vc = torch.zeros_like(kc)
            kc32, vc32 = kc.float(), vc.float()
            q_rot, k_rot = rotary_kv_write(q, k, v, positions, cos_sin, kc, vc, slots)
            rq, rk = reference.rotary_kv_write(q.float(), k.float(), v.float(), positions, cos_sin, kc32, vc32, slots)
            err = errors(torch.cat([q_rot.flatten(), kc.flatten()]), torch.cat([rq.flatten(), kc32.flatten()]))
            err["ok"] &= torch.equal(vc.float(), vc32)
            record("rotary_kv_write", f"{model} T={tokens}", err,
                   bench_ms(lambda: rotary_kv_write(q, k, v, positions, cos_sin, kc, vc, slots)),
                   bench_ms(lambda: reference.rotary_kv_write(q, k, v, positions, cos_sin, kc, vc, slots)))
    check_lora()
    pool = torch.randn(32, 2, 1024, BLOCK_SIZE, 8, HEAD_DIM, device="cuda", dtype=DTYPE)
    for n in (16, 256):
        ids = torch.randperm(1024, device="cuda")[:n]
        staging = gather_blocks(pool, ids)
        nbytes = 2 * staging.numel() * staging.element_size()  # read + write
        ms = bench_ms(lambda: gather_blocks(pool, ids))
        record("gather_blocks", f"L=32 n={n} H=8", {"ok": torch.equal(staging, reference.gather_blocks(pool, ids))},
               ms, bench_ms(lambda: reference.gather_blocks(pool, ids)), gbps=nbytes / ms / 1e6)
        expected = pool.clone()
        reference.scatter_blocks(expected, ids, staging.flip(0))
        scatter_blocks(pool, ids, staging.flip(0))
        ok = torch.equal(pool, expected)
        ms = bench_ms(lambda: scatter_blocks(pool, ids, staging))
        record("scatter_blocks", f"L=32 n={n} H=8", {"ok": ok},
               ms, bench_ms(lambda: reference.scatter_blocks(pool, ids, staging)), gbps=nbytes / ms / 1e6)


def check_lora(rank: int = 16, num_slots: int = 8) -> None:
    """llama3-8b's q/k/v (4096 -> 4096 + 1024 + 1024) at rank 16: the shrink over all three parts,
    the expand of q into its column slice; decode rows over 8 adapters and 1, a prompt over 4."""
    K, parts = 4096, 3
    a = torch.randn(num_slots, parts * rank, K, device="cuda", dtype=DTYPE) / K**0.5
    b = torch.randn(num_slots, 4096, rank, device="cuda", dtype=DTYPE) / rank**0.5
    scales = torch.rand(num_slots, device="cuda") + 0.5
    for tokens, adapters in ((64, 8), (64, 1), (4096, 4)):
        slots = torch.arange(tokens, device="cuda") % adapters
        order = torch.argsort(slots, stable=True)
        starts = torch.searchsorted(slots[order], torch.arange(adapters + 1, device="cuda")).int()
        segments = (order, starts, torch.arange(adapters, dtype=torch.int32, device="cuda"))
        x = torch.randn(tokens, K, device="cuda", dtype=DTYPE)
        shrunk = lora_shrink(x, a, *segments)
        record("lora_shrink", f"llama3-8b qkv T={tokens} adapters={adapters} r={rank}",
               errors(shrunk, reference.lora_shrink(x, a, *segments)),
               bench_ms(lambda: lora_shrink(x, a, *segments)), bench_ms(lambda: reference.lora_shrink(x, a, *segments)))
        out = torch.randn(tokens, 6144, device="cuda", dtype=DTYPE)
        ref = out.float()
        lora_expand(out[:, :4096], shrunk[:, :rank], b, *segments, scales)
        reference.lora_expand(ref[:, :4096], shrunk[:, :rank], b, *segments, scales)
        record("lora_expand", f"llama3-8b q slice T={tokens} adapters={adapters} r={rank}", errors(out, ref),
               bench_ms(lambda: lora_expand(out[:, :4096], shrunk[:, :rank], b, *segments, scales)),
               bench_ms(lambda: reference.lora_expand(out[:, :4096], shrunk[:, :rank], b, *segments, scales)))
        # the whole fused projection as the engine runs it: shrink of q, k and v, one expand over all
        b_all = torch.randn(num_slots, 6144, rank, device="cuda", dtype=DTYPE) / rank**0.5
        part_scales = torch.rand(parts, num_slots, device="cuda") + 0.5
        out = torch.randn(tokens, 6144, device="cuda", dtype=DTYPE)
        ref = out.float()
        lora_add(out, x, a, b_all, [0, 4096, 5120], part_scales, *segments)
        reference.lora_add(ref, x, a, b_all, [0, 4096, 5120], part_scales, *segments)
        record("lora_add", f"llama3-8b qkv T={tokens} adapters={adapters} r={rank}", errors(out, ref),
               bench_ms(lambda: lora_add(out, x, a, b_all, [0, 4096, 5120], part_scales, *segments)),
               bench_ms(lambda: reference.lora_add(out.float(), x, a, b_all, [0, 4096, 5120], part_scales,
                                                   *segments)))


def prefill_case(model, seq_lens, q_lens, window=None, sweep=False) -> None:
    hq, hk = MODELS[model]
    k_cache, v_cache, block_tables = paged_kv(seq_lens, hk)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    qsl = qsl.cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    run = lambda: prefill_attention(q, k_cache, v_cache, block_tables, qsl, lens, scale, window)  # noqa: E731
    ref = ref_prefill(q.float(), k_cache.float(), v_cache.float(), block_tables, qsl, lens, scale, window)
    err = errors(run(), ref)
    del ref
    ms = bench_ms(run)
    ref_ms = bench_ms(lambda: ref_prefill(q, k_cache, v_cache, block_tables, qsl, lens, scale, window))
    sdpa_ms = None
    if window is None and seq_lens == q_lens and len(set(seq_lens)) == 1:
        qd = q.view(len(seq_lens), seq_lens[0], hq, HEAD_DIM).transpose(1, 2).contiguous()
        kd, vd = dense_kv(k_cache, block_tables, seq_lens[0]), dense_kv(v_cache, block_tables, seq_lens[0])
        sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                                  enable_gqa=hq != hk))
    # causal FLOPs: 4 * D per visible (query, key) pair
    pairs = sum(sum(min(s - ql + i + 1, window or 1 << 62) for i in range(ql)) for s, ql in zip(seq_lens, q_lens))
    tflops = 4 * HEAD_DIM * hq * pairs / ms / 1e9
    shape = f"{model} q={q_lens[:3]}{'..' if len(q_lens) > 3 else ''} kv={seq_lens[:3]}{'..' if len(seq_lens) > 3 else ''}" + (f" w={window}" if window else "")
    record("prefill_attention", shape, err, ms, ref_ms, sdpa_ms=sdpa_ms, tflops=tflops)
    if sweep:
        out = torch.empty_like(q)
        for block_m, block_n, warps, stages in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 128, 8, 2),
                                                (128, 128, 4, 2), (64, 128, 4, 2), (128, 128, 8, 3)]:
            config = (block_m, block_n, warps, stages, prefill_module.HEAVY_FIRST)
            try:
                t = bench_ms(lambda: prefill_module._launch_prefill_attention(
                    q, k_cache, v_cache, block_tables, qsl, lens, out, scale, window, config=config))
                rows.append({"kernel": "prefill_sweep", "shape": shape, "config": [block_m, block_n, warps, stages],
                             "triton_ms": t, "default_ms": ms})
                print(f"    sweep BM={block_m} BN={block_n} warps={warps} stages={stages}: {t:.3f} ms "
                      f"(default {ms:.3f})", flush=True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                print(f"    sweep {block_m, block_n, warps, stages}: {type(exc).__name__}", flush=True)


def decode_case(model, num_seqs, context, window=None, sweep=False) -> None:
    hq, hk = MODELS[model]
    seq_lens = [context] * num_seqs
    k_cache, v_cache, block_tables = paged_kv(seq_lens, hk)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(num_seqs, hq, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    workspace = DecodeWorkspace.allocate(num_seqs, hq, HEAD_DIM, device="cuda")
    run = lambda: decode_attention(q, k_cache, v_cache, block_tables, lens, scale, window, workspace=workspace)  # noqa: E731
    ref = ref_decode(q.float(), k_cache.float(), v_cache.float(), block_tables, lens, scale, window)
    err = errors(run(), ref)
    ms = bench_ms(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph_ms = bench_ms(graph.replay)
    ref_ms = bench_ms(lambda: ref_decode(q, k_cache, v_cache, block_tables, lens, scale, window))
    sdpa_ms = None
    if window is None:
        qd = q.unsqueeze(2)
        kd, vd = dense_kv(k_cache, block_tables, context), dense_kv(v_cache, block_tables, context)
        sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=hq != hk))
    visible = min(context, window or context)
    kv_bytes = 2 * num_seqs * visible * hk * HEAD_DIM * 2
    splits = decode_module.num_kv_splits(num_seqs, hk, block_tables.shape[1] * BLOCK_SIZE if window is None
                                         else min(window, block_tables.shape[1] * BLOCK_SIZE), q.device)
    shape = f"{model} B={num_seqs} ctx={context}" + (f" w={window}" if window else "") + f" splits={splits}"
    record("decode_attention", shape, err, ms, ref_ms, sdpa_ms=sdpa_ms, graph_ms=graph_ms,
           gbps=kv_bytes / graph_ms / 1e6, kv_bytes=kv_bytes, num_splits=splits)
    if sweep:
        out = torch.empty_like(q)
        block_n, warps, stages, ids = decode_config._tile_config(HEAD_DIM, q.dtype, num_seqs * hk)
        for s in (1, 2, 4, 8, 16, 32, 64):
            sweep_ws = DecodeWorkspace.allocate(num_seqs, hq, HEAD_DIM, s, device="cuda")
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    decode_module._launch_decode_attention(q, k_cache, v_cache, block_tables, lens, out, scale, window,
                                                           sweep_ws, config=(block_n, warps, stages, s),
                                                           ids_in_registers=ids)
                t = bench_ms(g.replay)
                rows.append({"kernel": "decode_sweep", "shape": shape, "num_splits": s, "graph_ms": t,
                             "gbps": kv_bytes / t / 1e6, "default_graph_ms": graph_ms})
                print(f"    sweep splits={s:2d}: {t:.4f} ms  {kv_bytes / t / 1e6:6.0f} GB/s "
                      f"(default {graph_ms:.4f})", flush=True)
            except Exception as exc:  # noqa: BLE001 - e.g. a workspace the shape does not fit
                print(f"    sweep splits={s}: {type(exc).__name__}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the result rows")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--sweep", action="store_true", help="also sweep decode splits and prefill tiles")
    parser.add_argument("--only", choices=["elementwise", "prefill", "decode"], nargs="*")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'kernel':18s} {'shape':44s} chk  rel_err  triton_ms  ref_ms  speedup  sdpa_ms   GB/s")
    only = set(args.only or ["elementwise", "prefill", "decode"])
    if "elementwise" in only:
        check_elementwise()
    if "prefill" in only:
        for model in MODELS:
            contexts = (512, 4096) if args.quick else (128, 1024, 4096, 8192)
            for n in contexts:
                prefill_case(model, [n], [n], sweep=args.sweep and n == 4096)
            prefill_case(model, [4096 + 512], [512])  # chunked context
            prefill_case(model, [1024] * 8, [1024] * 8)
            prefill_case(model, [8192], [8192], window=1024)
            prefill_case(model, [3000, 77, 1500, 9000], [3000, 77, 200, 1])
    if "decode" in only:
        for model in MODELS:
            for num_seqs in (1, 8, 32, 64):
                for context in ((1024, 8192) if args.quick else (128, 1024, 4096, 8192)):
                    sweep = args.sweep and (num_seqs, context) in ((1, 8192), (8, 8192), (32, 8192), (64, 1024))
                    decode_case(model, num_seqs, context, sweep=sweep)
            decode_case(model, 32, 8192, window=1024)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r.get("ok") is False]
    print(f"{len(rows)} rows -> {args.out}; {len(bad)} failed checks")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
