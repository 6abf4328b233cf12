"""kernels.compile_watch: compilations are counted from start-up and, once the worker serves,
each is a warning naming the kernel and its specialization."""

from __future__ import annotations

from types import SimpleNamespace

import structlog
import triton

from tandem.kernels import compile_watch
from tandem.kernels.compile_watch import CompileWatch


def test_compilations_while_serving_are_warnings_with_the_kernel_named():
    watch = CompileWatch()
    fn = SimpleNamespace(module="tandem.kernels.prefill_attention", name="_prefill_attention_kernel")
    with structlog.testing.capture_logs() as logs:
        watch.hook(key=(), repr="_prefill_attention_kernel[num_warps=4](BLOCK_M: 16)", fn=fn, compile={},
                   is_manual_warmup=False, already_compiled=False)
        watch.serving()
        watch.hook(key=(), repr="_prefill_attention_kernel[num_warps=4](BLOCK_M: 64)", fn=fn, compile={},
                   is_manual_warmup=False, already_compiled=False)
    assert (watch.compiled, watch.compiled_serving) == (2, 1)
    assert [entry["log_level"] for entry in logs] == ["warning"]  # the start-up's compilation is not one
    assert logs[0]["kernel"] == "tandem.kernels.prefill_attention._prefill_attention_kernel"
    assert "BLOCK_M: 64" in logs[0]["specialization"]


def test_install_hooks_triton_once_and_keeps_anothers_hook():
    runtime = triton.knobs.runtime
    saved = runtime.jit_post_compile_hook
    try:
        runtime.jit_post_compile_hook = None
        assert compile_watch.install() and compile_watch.install()
        assert runtime.jit_post_compile_hook == compile_watch.WATCH.hook

        def other(**kwargs):
            return None

        runtime.jit_post_compile_hook = other
        assert not compile_watch.install()
        assert runtime.jit_post_compile_hook is other
    finally:
        runtime.jit_post_compile_hook = saved
