"""Compile the FP8 GEMV for sm90 (no GPU needed) and check in its PTX that each iteration of the
K loop issues all its global loads before its first barrier.

With E4M3 weights, x (bf16) is loaded in a layout of its own and moved to the weight tile's
through shared memory, between two barriers, every tile. A weight load placed after them waits
for x's round trip and the barriers before it is even issued: two memory latencies a tile. The
weight tile is therefore loaded first; this check keeps it so. It also checks that the
F16_PRODUCTS form multiplies and accumulates in f16x2 (no fp32 FMA, no widening to fp32 in the
loop) and the others in fp32. Run by tests/kernels/test_gemv.py
in a process of its own (the kernel tests run Triton in the interpreter).

    python3 tests/kernels/gemv_ptx_check.py      (from the repository root)
"""

import itertools
import re
import sys

from pdl_ptx_check import _FP8_POINTERS, _ptx

from tandem.kernels.gemv import _gemv_kernel


def loop_body(lines: list[str]) -> list[str]:
    """The lines of the one loop: from the label a backward branch jumps to, to that branch."""
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:$", line)}
    for i, line in enumerate(lines):
        target = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if target and labels.get(target.group(1), i) < i:
            return lines[labels[target.group(1)]:i]
    raise AssertionError("no loop in the kernel")


def main() -> int:
    checked = 0
    for silu, even_k, prefetch, f16 in itertools.product((False, True), repeat=4):
        constexprs = {"BLOCK_N": 4, "BLOCK_K": 512 if silu else 2048, "EVEN_K": even_k, "HAS_BIAS": False,
                      "SILU_MUL": silu, "W_SCALED": True, "PREFETCH": prefetch, "F16_PRODUCTS": f16}
        lines, _ = _ptx(_gemv_kernel, constexprs, divisible=("K", "stride_wn"), pointers=_FP8_POINTERS)
        body = loop_body(lines)
        loads = [i for i, line in enumerate(body) if "ld.global" in line]
        barriers = [i for i, line in enumerate(body) if line.startswith("bar.sync")]
        assert loads, f"no load in the loop: {constexprs}"
        assert not barriers or max(loads) < barriers[0], \
            f"a global load after the loop's first barrier ({constexprs}): {body[max(loads)]}"
        ops = [line.split()[0] for line in body]
        if f16:  # one f16x2 FMA per two elements, nothing widened to fp32 in the loop
            assert "fma.rn.f16x2" in ops and "cvt.f32.f16" not in ops and "fma.rn.f32" not in ops, \
                f"F16_PRODUCTS left fp32 math in the loop ({constexprs})"
        else:
            assert "fma.rn.f32" in ops and "fma.rn.f16x2" not in ops, f"fp32 products expected ({constexprs})"
        checked += 1
    print(f"ok: {checked} FP8 GEMV forms issue every load before the loop's barriers, "
          "F16_PRODUCTS' in f16x2 and the others' in fp32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
