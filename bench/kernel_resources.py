"""Registers and shared memory per program of the decode attention kernel (llama2-7b, batch 64)
and the gate/up skinny GEMM tiles at 64 rows, as compiled on this GPU: programs per SM
decide these kernels (docs/kernels.md). (on a GPU machine: source scripts/gpu_env.sh first)
    python3 -m tandem.bench.kernel_resources"""
import torch

import tandem.kernels.decode_attention as da
import tandem.kernels.skinny_gemm as sg
from tandem.kernels.decode_config import DecodeWorkspace


def compiled(jit_fn, launch):
    """Run ``launch`` and return the CompiledKernel of its (last) launch of ``jit_fn``."""
    seen, run = [], jit_fn.run

    def spy(*args, **kwargs):
        seen.append(run(*args, **kwargs))
        return seen[-1]
    jit_fn.run = spy
    try:
        launch()
        torch.cuda.synchronize()
    finally:
        jit_fn.run = run
    return seen[-1]


def report(name, k):
    print(f"{name:28s} regs {k.n_regs:4d}  spills {k.n_spills:4d}  shared {k.metadata.shared / 1024:6.1f} KB  "
          f"warps {k.metadata.num_warps}", flush=True)


seqs, heads, dim, bs = 64, 32, 128, 16
width = 4096 // bs  # the engine's graphs: block tables for 4096 tokens (tandem.bench.engine)
blocks = seqs * width + 8
k_cache = torch.randn(blocks, bs, heads, dim, device="cuda", dtype=torch.bfloat16)
v_cache = torch.randn_like(k_cache)
tables = torch.arange(seqs * width, device="cuda", dtype=torch.int32).view(seqs, width)
lens = torch.full((seqs,), 257, device="cuda", dtype=torch.int32)
q = torch.randn(seqs, heads, dim, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
for ids, tile in ((False, None), (True, None), (True, (64, 4, 3)), (True, (32, 4, 3)), (True, (32, 4, 4)),
                  (True, (16, 4, 4)), (True, (32, 2, 3))):
    k = compiled(da._decode_partial_kernel, lambda: da._launch_decode_attention(
        q, k_cache, v_cache, tables, lens, out, dim**-0.5, None, DecodeWorkspace.allocate(seqs, heads, dim),
        config=tile and (*tile, 1), ids_in_registers=ids))
    report(f"decode attention ids {int(ids)} {tile or 'rule'}", k)
for cap in (96, 80):
    k = compiled(da._decode_partial_kernel, lambda: da._launch_decode_attention(
        q, k_cache, v_cache, tables, lens, out, dim**-0.5, None, DecodeWorkspace.allocate(seqs, heads, dim),
        max_registers=cap))
    report(f"decode attention cap {cap}", k)
x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(22016, 4096, device="cuda", dtype=torch.bfloat16)
y = torch.empty(64, 11008, device="cuda", dtype=torch.bfloat16)
for tile in (None, (128, 64, 8, 4, 1), (64, 64, 4, 3, 1)):
    k = compiled(sg._skinny_kernel, lambda: sg._launch_skinny(x, w, None, y, silu_mul=True, config=tile))
    report(f"gate_up 64 rows {tile or sg.tile_config(64, 22016, 4096, True)}", k)
