"""Triton compilations after start-up, named in the log.

Each Triton kernel variant (its constexprs, the alignment and divisibility of its arguments,
its launch options) is compiled on first use, for half a second to a second on a fresh
machine. A worker compiles what it knows it will need before it serves
(``engine.warmup``, the CUDA-graph captures); a variant its warm-up missed compiles inside a
step of real traffic, and that step stalls every stream of the batch. ``serving()`` (the
worker loop calls it) turns each later compilation into a warning that names the kernel and
the specialization it was compiled for, so a stall in the step statistics has its cause in the
same log, and the warm-up can be made to cover it.
"""

from __future__ import annotations

import threading

import structlog

log = structlog.get_logger(__name__)


class CompileWatch:
    """Counts compilations; once ``serving``, logs each one as a warning."""

    def __init__(self):
        self._lock = threading.Lock()
        self.compiled = 0  # every compilation this process ran
        self.compiled_serving = 0  # those after serving()
        self.is_serving = False

    def hook(self, *, key=None, repr: str = "", fn=None, compile=None, is_manual_warmup: bool = False,
             already_compiled: bool = False, **_: object) -> None:
        """``triton.knobs.runtime.jit_post_compile_hook``: called after each compilation with the
        kernel (``fn``: module and name) and ``repr``, its launch options and argument
        specialization."""
        with self._lock:
            self.compiled += 1
            serving = self.is_serving
            if serving:
                self.compiled_serving += 1
        if serving:
            name = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"
            log.warning("kernel compiled while serving", kernel=name, specialization=repr,
                        compiled_serving=self.compiled_serving)

    def serving(self) -> None:
        with self._lock:
            self.is_serving = True


WATCH = CompileWatch()


def install() -> bool:
    """Hook ``WATCH`` into Triton (once; a hook someone else set is kept and nothing is
    installed); -> whether it is installed."""
    try:
        from triton import knobs
    except ImportError:  # a Triton without knobs: nothing to watch with
        return False
    runtime = knobs.runtime
    current = runtime.jit_post_compile_hook
    if current == WATCH.hook:  # (a bound method: equal, not identical, each time)
        return True
    if current is not None:
        return False
    runtime.jit_post_compile_hook = WATCH.hook
    return True


def serving() -> None:
    """From now on each compilation is a warning (the worker serves traffic)."""
    if install() and not WATCH.is_serving:
        log.info("kernels compiled before serving", compiled=WATCH.compiled)
    WATCH.serving()
