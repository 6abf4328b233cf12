"""launch_keys: the key Triton compiles a launch for, worked out without compiling (the warm-up
coverage test, tests/engine/test_warm_up_coverage.py, stands on it)."""

import sys

import torch
import triton
import triton.language as tl

from tests.kernels.launch_keys import launch_key, recording, unlike


@triton.jit(do_not_specialize=["rows"], do_not_specialize_on_alignment=["lens_ptr"])
def _kernel(x_ptr, lens_ptr, rows, stride, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def _launch(x, lens, rows, stride, block=16, **options):
    _kernel[(1,)](x, lens, rows, stride, 0.5, BLOCK=block, **options)


def test_pointers_by_alignment_integers_by_class_unless_the_kernel_says_otherwise():
    x = torch.zeros(64, dtype=torch.int32)
    key = launch_key(_kernel, (x, x, 3, 32, 0.5), {"BLOCK": 16})
    assert key[1] == (("BLOCK", 16), ("FLAG", False))  # the constexprs, defaults included
    assert dict(key[2]) == {"x_ptr": ("*i32", "D"), "lens_ptr": ("*i32", ""), "rows": ("i32", None),
                            "stride": ("i32", "D"), "scale": "fp32"}
    same = [launch_key(_kernel, (x, x[1:], rows, 48, 0.25), {"BLOCK": 16}) for rows in (1, 16, 1000)]
    assert set(same) == {key}  # lens' alignment and rows' value are not specialized
    assert launch_key(_kernel, (x[1:], x, 3, 32, 0.5), {"BLOCK": 16}) != key  # x's alignment is
    assert dict(launch_key(_kernel, (x, x, 3, 1, 0.5), {"BLOCK": 16})[2])["stride"] == ("constexpr", 1)
    assert dict(launch_key(_kernel, (x, x, 3, 33, 0.5), {"BLOCK": 16})[2])["stride"] == ("i32", "")
    assert launch_key(_kernel, (x, x, 3, 32, 0.5), {"BLOCK": 16, "num_warps": 8})[3] == (("num_warps", 8),)


def test_recorded_launches_run_nothing_and_say_what_sets_them_apart():
    x = torch.zeros(64, dtype=torch.int32)
    module = sys.modules[__name__]
    with recording(module, "_kernel") as launches:
        _launch(x, x, 3, 32)
        _launch(x, x, 5, 32)
        _launch(x, x, 3, 32, block=32)
        _launch(x, x, 3, 7)
    assert len(launches.keys) == 4 and len(launches.distinct()) == 3
    first = launches.keys[0]
    assert unlike(launches.keys[2], {first}) == "_kernel: BLOCK=32 (had 16)"
    assert unlike(launches.keys[3], {first}) == "_kernel: stride: ('i32', '') (had ('i32', 'D'))"
    assert module._kernel is not None and not hasattr(module._kernel, "launches")  # put back
