"""Compile every PDL kernel for sm90 (no GPU needed) and check in its PTX that each program
waits for its predecessor (griddepcontrol.wait) unconditionally, before any store and before any
load but of its constant weights. Run by tests/kernels/test_pdl.py in a process of its own: the
kernel tests run Triton in the interpreter, where kernels cannot be compiled.

    python3 tests/kernels/pdl_ptx_check.py      (from the repository root)
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget

from tandem.kernels.activation import _silu_mul_fp8_kernel, _silu_mul_kernel
from tandem.kernels.decode_attention import _decode_partial_kernel, _decode_reduce_kernel
from tandem.kernels.gemv import _gemv_kernel
from tandem.kernels.lora import _lora_expand_kernel, _lora_shrink_kernel
from tandem.kernels.rms_norm import _fused_add_rms_norm_kernel
from tandem.kernels.rotary import _rotary_kv_write_kernel
from tandem.kernels.skinny_gemm import _skinny_kernel, _split_sum_kernel

_POINTER_TYPES = {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i64",
                  "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "partial_out_ptr": "*fp32",
                  "partial_lse_ptr": "*fp32", "ws_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
_SKINNY_DIVISIBLE = ("K", "stride_xm", "stride_wn", "stride_ym")
_FP8_POINTERS = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}


def _ptx(fn, constexprs, divisible=(), pointers=None) -> tuple[list[str], list[str]]:
    """``divisible``: integer arguments specialized as multiples of 16, as a real launch's K and
    strides are (Triton pipelines the skinny GEMMs' loops only then). ``pointers``: element types
    of pointer arguments other than the defaults (FP8 weights)."""
    pointer_types = {**_POINTER_TYPES, **(pointers or {})}
    signature, attrs = {}, {}
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = {**{k: v for k, v in defaults.items() if k != "USE_PDL"}, **constexprs}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name == "USE_PDL":
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in ("eps", "qk_scale") else "i32"
            if name in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn, signature, {**constexprs, "USE_PDL": True}, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True, "num_warps": 4})
    lines = [line.split("//")[0].strip() for line in kernel.asm["ptx"].splitlines()]
    return [line for line in lines if line], fn.arg_names


def _check_waits_first(lines, arg_names, constant_params):
    waits = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    assert len(waits) == 1, "exactly one wait"
    before = lines[: waits[0]]
    assert not any(re.search(r"\bbra\b|\bret\b|\bexit\b|^\$L__BB", line) for line in before), \
        "the wait must be unconditional: every program runs it"
    tainted = set()  # registers derived from a pointer to memory another kernel may write
    derived = {name: set() for name in constant_params}  # registers derived from each early-load pointer
    loaded = set()  # early-load pointers some load before the wait reads through
    for line in before:
        param = re.match(r"ld\.param\.\w+\s+(%\w+),\s*\[\w+_param_(\d+)\]", line)
        if param:
            name = arg_names[int(param.group(2))]
            if name.endswith("_ptr") and name not in constant_params:
                tainted.add(param.group(1))
            if name in derived:
                derived[name].add(param.group(1))
            continue
        assert not re.search(r"\b(st|red|atom)\.global|cp\.async", line), f"a write before the wait: {line}"
        if "ld.global" in line:
            address = re.search(r"\[\s*(%\w+)", line).group(1)
            assert address not in tainted, f"an activation read before the wait: {line}"
            loaded.update(name for name, regs in derived.items() if address in regs)
        registers = re.findall(r"%\w+", line)
        destination = re.findall(r"%\w+", line.split(",")[0])
        if len(registers) > 1 and any(r in tainted for r in registers[1:]):
            tainted.update(destination)
        for regs in derived.values():
            if len(registers) > 1 and any(r in regs for r in registers[1:]):
                regs.update(destination)
    # what it may load early, it does load early (the point of PDL for it): the weights; the KV tile
    assert loaded == set(constant_params), \
        f"loads before the wait through {sorted(loaded)}, not all of {sorted(constant_params)}"


_KERNELS = [
    (_fused_add_rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096}, ()),
    (_silu_mul_kernel, {"BLOCK": 2048}, ()),
    (_rotary_kv_write_kernel, {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8}, ()),
    (_decode_partial_kernel, dict(GROUP=4, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=128, HAS_WINDOW=False,
                                  DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True), ()),
    (_decode_partial_kernel, dict(GROUP=1, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=128, HAS_WINDOW=True,
                                  DIRECT_OUT=True, DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True,
                                  NEW_TOKEN=True), ()),
    # the fused form with PREFETCH loads the KV cache, block tables and lengths before it waits:
    # the kernels before it in a step never write them (kernels/decode_attention.py)
    (_decode_partial_kernel, dict(GROUP=4, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=128, HAS_WINDOW=False,
                                  DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True,
                                  NEW_TOKEN=True, PREFETCH=True),
     ("k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr")),
    (_decode_partial_kernel, dict(GROUP=4, GROUP_PAD=16, BLOCK_N=32, HEAD_DIM=64, HAS_WINDOW=True,
                                  DIRECT_OUT=True, DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True,
                                  NEW_TOKEN=True, PREFETCH=True),
     ("k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr")),
    (_decode_partial_kernel, dict(GROUP=1, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=128, HAS_WINDOW=False,
                                  DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True,
                                  NEW_TOKEN=True, PREFETCH=True),  # MHA (llama2-7b) at batch 1
     ("k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr")),
    # wide grids: 32-token tiles, the block ids in registers (loaded from entry 0, or from the share's first block)
    (_decode_partial_kernel, dict(GROUP=1, GROUP_PAD=16, BLOCK_N=32, HEAD_DIM=128, HAS_WINDOW=False,
                                  DIRECT_OUT=True, DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True,
                                  IDS_REG=512), ()),
    (_decode_partial_kernel, dict(GROUP=4, GROUP_PAD=16, BLOCK_N=32, HEAD_DIM=128, HAS_WINDOW=True,
                                  DIRECT_OUT=False, DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True,
                                  IDS_REG=64), ()),
    (_decode_reduce_kernel, dict(SPLITS_PAD=8, HEAD_DIM=128), ()),
] + [
    (_gemv_kernel, dict(BLOCK_N=n, BLOCK_K=k, EVEN_K=even, HAS_BIAS=bias, SILU_MUL=silu), ("w_ptr",))
    for silu, even, bias, n, k in [(False, True, False, 4, 1024), (False, False, True, 8, 1024),
                                   (True, True, False, 4, 512), (True, False, False, 4, 512)]
] + [
    (_skinny_kernel, dict(BLOCK_M=m, BLOCK_N=64, BLOCK_K=k, EVEN_K=even, HAS_BIAS=bias, SILU_MUL=silu,
                          WORKSPACE=split, DOT_PRECISION="tf32", DOT_UPCAST=False), ("w_ptr",), _SKINNY_DIVISIBLE)
    for m, k, even, bias, silu, split in [(64, 128, True, False, False, False), (64, 128, False, True, False, True),
                                          (64, 64, True, False, True, False), (128, 64, False, False, True, True)]
] + [  # FP8 weights: E4M3 rows, fp32 row scales (read after the wait, with the sums)
    (_gemv_kernel, dict(BLOCK_N=4, BLOCK_K=1024, EVEN_K=True, HAS_BIAS=False, SILU_MUL=silu, W_SCALED=True),
     ("w_ptr",), (), _FP8_POINTERS)
    for silu in (False, True)
] + [
    (_skinny_kernel, dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, EVEN_K=True, HAS_BIAS=False, SILU_MUL=silu,
                          WORKSPACE=split, DOT_PRECISION="tf32", DOT_UPCAST=False, W_SCALED=True), ("w_ptr",),
     _SKINNY_DIVISIBLE, _FP8_POINTERS)
    for m, n, k, silu, split in [(16, 64, 128, False, False), (64, 64, 128, False, True), (64, 128, 64, True, False)]
] + [(_split_sum_kernel, dict(SPLIT_K=2, BLOCK=1024, HAS_BIAS=True, SILU_MUL=True), ()),
     (_split_sum_kernel, dict(SPLIT_K=2, BLOCK=4096, HAS_BIAS=False, SILU_MUL=False, ADD_NORM=True), ())]
# an FP8 KV cache (E4M3 codes, its per-head scales read after the wait): the same rules
_FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
_DECODE = dict(GROUP=4, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=128, HAS_WINDOW=False, DIRECT_OUT=False,
               DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True, KV_FP8=True)
_KERNELS += [
    (_rotary_kv_write_kernel, {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "KV_FP8": True}, (), (), _FP8_CACHE),
    (_decode_partial_kernel, _DECODE, (), (), _FP8_CACHE),
    (_decode_partial_kernel, {**_DECODE, "DIRECT_OUT": True, "NEW_TOKEN": True}, (), (), _FP8_CACHE),
    (_decode_partial_kernel, {**_DECODE, "NEW_TOKEN": True, "PREFETCH": True},
     ("k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr"), (), _FP8_CACHE),
    (_decode_partial_kernel, {**_DECODE, "GROUP": 1, "BLOCK_N": 32, "DIRECT_OUT": True, "IDS_REG": 512}, (), (),
     _FP8_CACHE),
    # the register-prefetch tuning form: its first tile's loads come after the wait too
    (_decode_partial_kernel, {**_DECODE, "DIRECT_OUT": True, "IDS_REG": 32, "REG_PREFETCH": True, "V_DEQUANT": True,
                              "F16_DOT": True}, (), (), _FP8_CACHE),
]

# LoRA (a step's adapter rows): the shrink's fp32 partials, the expand's scales; rows by segment
_LORA = {"order_ptr": "*i64", "starts_ptr": "*i32", "slots_ptr": "*i32", "scales_ptr": "*fp32"}
_KERNELS += [
    (_lora_shrink_kernel, dict(BLOCK_M=64, BLOCK_R=64, BLOCK_K=64, DOT_PRECISION="tf32", DOT_UPCAST=False), (), (),
     {**_LORA, "out_ptr": "*fp32"}),
    (_lora_expand_kernel, dict(PARTS=3, BLOCK_M=64, BLOCK_N=64, BLOCK_R=16), (), (), {**_LORA, "s_ptr": "*fp32"}),
    # o's and down's expand inside the add-norm after them (kernels.lora_rows)
    (_fused_add_rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096, "LORA": True}, (), (),
     {"lp_ptr": "*fp32", "lb_ptr": "*bf16", "ls_ptr": "*fp32", "lslot_ptr": "*i64"}),
    # and in the skinny GEMM's add-norm finish, from a fused weight's extra columns
    (_split_sum_kernel, dict(SPLIT_K=2, BLOCK=4096, HAS_BIAS=False, SILU_MUL=False, ADD_NORM=True, LORA=True,
                             SPLITS_PAD=2), (), (),
     {"ws_ptr": "*fp32", "lb_ptr": "*bf16", "ls_ptr": "*fp32", "lslot_ptr": "*i64"}),
]


# the norm and the SiLU·mul that write their output as E4M3 codes and fp32 row scales (Fp8Rows)
_KERNELS += [
    (_fused_add_rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096, "FP8_OUT": True}, (), (),
     {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
    (_silu_mul_fp8_kernel, {"BLOCK": 4096, "FP8_LIMIT": 448.0, "SOFT_ROUND": False}, (), (),
     {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}),
    (_split_sum_kernel, dict(SPLIT_K=2, BLOCK=4096, HAS_BIAS=False, SILU_MUL=False, ADD_NORM=True, FP8_OUT=True), (),
     (), {"y_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "ys_ptr": "*fp32"}),
]

def main() -> int:
    for fn, constexprs, constant_params, *divisible in _KERNELS:
        lines, arg_names = _ptx(fn, constexprs, *divisible)
        _check_waits_first(lines, arg_names, constant_params)
    print(f"ok: {len(_KERNELS)} kernels wait first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
