"""Compile the decode attention over an FP8 cache for sm90 (no GPU needed) and check in its PTX
how P.V's V operand leaves shared memory: with V_DEQUANT (V widened to 16 bits with its scale in
the tile), by transposing ldmatrix and no byte-wide shared-memory load; without it, as 8-bit
codes, a byte at a time (ldmatrix transposes only 16-bit elements). Run by
tests/kernels/test_fp8_kv_cache.py in a process of its own (the kernel tests run Triton in the
interpreter).

    python3 tests/kernels/fp8_attention_ptx_check.py      (from the repository root)
"""

import sys

from pdl_ptx_check import _ptx

from tandem.kernels.decode_attention import _decode_partial_kernel

FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
STRIDES = ("stride_k_block", "stride_k_slot", "stride_k_head", "stride_v_block", "stride_v_slot", "stride_v_head")


def main() -> int:
    for v_dequant in (False, True):
        constexprs = dict(GROUP=4, GROUP_PAD=16, BLOCK_N=128, HEAD_DIM=128, HAS_WINDOW=False, DIRECT_OUT=False,
                          DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True, KV_FP8=True,
                          V_DEQUANT=v_dequant)
        lines, _ = _ptx(_decode_partial_kernel, constexprs, divisible=STRIDES, pointers=FP8_CACHE)
        byte_reads = sum(line.startswith("ld.shared.b8") for line in lines)
        transposed = sum(line.startswith("ldmatrix") and ".trans." in line for line in lines)
        print(f"V_DEQUANT={v_dequant}: {byte_reads} byte-wide shared loads, {transposed} transposing ldmatrix")
        if v_dequant:
            assert byte_reads == 0 and transposed > 0, "V_DEQUANT's V must leave shared memory by ldmatrix"
        else:
            assert byte_reads > 0, "the 8-bit V operand's reads changed: update docs/kernels.md and this check"
    print("ok: the FP8 cache's V operand reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
