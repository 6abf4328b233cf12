"""Compile the decode attention over an FP8 cache for sm90 (no GPU needed) and check in its PTX
how P.V's V operand leaves shared memory: with V_DEQUANT (V widened to 16 bits with its scale in
the tile), by transposing ldmatrix and no byte-wide shared-memory load; without it, as 8-bit
codes, a byte at a time (ldmatrix transposes only 16-bit elements). With F16_DOT (MHA, one KV
head a program: the wide-grid case) as well: V by transposing ldmatrix, every E4M3 pair widened
by one cvt.rn.f16x2.e4m3x2 and nothing more (no conversion to bf16 or from fp16 to fp32 in the
loop; P goes to fp16 from fp32), fp16 MMAs. With FP8_QK (the scores from an E4M3 product): the
scores by wgmma over E4M3 codes, and half F16_DOT's conversions a tile (V's alone). Run by
tests/kernels/test_fp8_decode_attention.py in a process of its own (the kernel tests run Triton in the
interpreter).

    python3 tests/kernels/fp8_attention_ptx_check.py      (from the repository root)
"""

import re
import sys

from pdl_ptx_check import _ptx

from tandem.kernels.decode_attention import _decode_partial_kernel

FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
STRIDES = ("stride_k_block", "stride_k_slot", "stride_k_head", "stride_v_block", "stride_v_slot", "stride_v_head")


def _blocks(lines: list[str]) -> list[list[str]]:
    """The PTX's basic blocks, each as its instructions."""
    blocks, current = [], []
    for line in lines:
        if re.match(r"^\$L__BB\d+_\d+:", line):
            blocks.append(current)
            current = []
        else:
            current.append(line)
    blocks.append(current)
    return blocks


def _loop(lines: list[str]) -> list[str]:
    """The instructions of the basic block holding the most MMAs: the loop over the tiles."""
    return max(_blocks(lines), key=lambda block: sum(line.startswith("mma.") for line in block))


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
    constexprs = dict(GROUP=1, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=128, HAS_WINDOW=False, DIRECT_OUT=False,
                      DOT_PRECISION="tf32", DOT_UPCAST=False, HEADS_FIRST=True, KV_FP8=True, V_DEQUANT=True,
                      IDS_REG=32, F16_DOT=True)
    lines, _ = _ptx(_decode_partial_kernel, constexprs, divisible=STRIDES, pointers=FP8_CACHE)
    loop = _loop(lines)
    byte_reads = sum(line.startswith("ld.shared.b8") for line in lines)
    transposed = sum(line.startswith("ldmatrix") and ".trans." in line for line in loop)
    widened = sum(line.startswith("cvt.rn.f16x2.e4m3x2") for line in loop)
    other_cvt = [line.split()[0] for line in loop if line.startswith(("cvt.bf16", "cvt.f32", "cvt.rn.bf16"))]
    f16_mma = sum(line.startswith("mma.") and ".f16.f16." in line for line in loop)
    print(f"F16_DOT: {byte_reads} byte-wide shared loads, {transposed} transposing ldmatrix, {widened} "
          f"E4M3 pair conversions, conversions to bf16 or fp32 {sorted(set(other_cvt))}, {f16_mma} fp16 MMAs")
    assert byte_reads == 0 and transposed > 0, "F16_DOT's V must leave shared memory by ldmatrix"
    assert widened > 0 and not other_cvt and f16_mma > 0, "F16_DOT widens by cvt.rn.f16x2.e4m3x2 alone"
    lines, _ = _ptx(_decode_partial_kernel, {**constexprs, "GROUP": 4, "FP8_QK": True}, divisible=STRIDES,
                    pointers=FP8_CACHE)
    loop = max(_blocks(lines), key=lambda block: sum(line.startswith("wgmma.mma_async") for line in block))
    fp8_mma = sum(line.startswith("wgmma.mma_async") and ".e4m3.e4m3" in line for line in loop)
    qk_widened = sum(line.startswith("cvt.rn.f16x2.e4m3x2") for line in loop)
    print(f"FP8_QK: {fp8_mma} E4M3 wgmma, {qk_widened} E4M3 pair conversions a tile (F16_DOT: {widened})")
    assert fp8_mma > 0 and qk_widened * 2 == widened, "FP8_QK: the scores by E4M3 wgmma, only V widened"
    print("ok: the FP8 cache's V operand reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
