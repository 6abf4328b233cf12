"""What a Triton launch is compiled for, worked out on the CPU without compiling or running it.

Triton compiles one binary per kernel for each distinct key of its launches: the constexpr
values, the launch options (warps, stages, PDL, register cap) and, for every other argument,
how it is specialized: a pointer by whether its address is a multiple of 16 bytes, an integer
by whether it is 1, a multiple of 16, or needs 64 bits, unless the kernel lists the argument in
``do_not_specialize`` / ``do_not_specialize_on_alignment``. Two launches with equal keys run
the same binary; a launch whose key no warm-up launch had compiles inside a step of traffic.

``recording(module, *names)`` replaces the named kernels of a kernel module by recorders: a
launch through the module's launcher then adds its key to ``Launches.keys`` and runs nothing
(its outputs stay as allocated).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from triton.backends.compiler import BaseBackend

try:
    from triton.runtime.jit import native_specialize_impl
except ImportError:  # a Triton without the native binder (the GPU machine's may be older): tests skip
    native_specialize_impl = None

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid")


@dataclass(frozen=True)
class Param:
    name: str
    constexpr: bool
    specialize: bool  # integers: 1 and multiples of 16 get binaries of their own
    align: bool  # pointers: 16-byte aligned addresses get binaries of their own
    default: object = inspect.Parameter.empty


def kernel_params(kernel) -> list[Param]:
    """A ``@triton.jit`` kernel's parameters, compiled (JITFunction) or interpreted alike."""
    if hasattr(kernel, "params"):  # JITFunction
        flags = {p.name: (p.do_not_specialize, p.do_not_specialize_on_alignment) for p in kernel.params}
    else:  # InterpretedFunction: the decorator's keywords, by name or position
        skip = set(kernel.kwargs.get("do_not_specialize") or ())
        skip_align = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
        names = inspect.signature(kernel.fn).parameters
        flags = {name: (name in skip or i in skip, name in skip_align or i in skip_align)
                 for i, name in enumerate(names)}
    params = []
    for name, param in inspect.signature(kernel.fn).parameters.items():
        no_spec, no_align = flags[name]
        params.append(Param(name, "constexpr" in str(param.annotation), not no_spec, not no_align, param.default))
    return params


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key Triton compiles ``kernel[grid](*args, **kwargs)`` for (module docstring)."""
    if native_specialize_impl is None:
        pytest.skip("this Triton has no native_specialize_impl to work out launch keys with")
    params = kernel_params(kernel)
    values = dict(zip((p.name for p in params), args))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    constants, specialized = [], []
    for p in params:
        value = values.get(p.name, p.default)
        if value is inspect.Parameter.empty:
            raise TypeError(f"{kernel.fn.__name__}: no value for {p.name}")
        if p.constexpr:
            constants.append((p.name, value))
        elif isinstance(value, float):  # floats are never specialized
            specialized.append((p.name, "fp32"))
        else:
            specialized.append((p.name, native_specialize_impl(BaseBackend, value, False, p.specialize, p.align)))
    options = tuple(sorted((k, kwargs[k]) for k in LAUNCH_OPTIONS if k in kwargs))
    return kernel.fn.__name__, tuple(constants), tuple(specialized), options


@dataclass
class Launches:
    keys: list[tuple] = field(default_factory=list)

    def distinct(self) -> set[tuple]:
        return set(self.keys)


class _Recorder:
    def __init__(self, kernel, launches: Launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.keys.append(launch_key(self.kernel, args, kwargs))
        return launch


@contextmanager
def recording(module, *names: str):
    """Within: launches of ``module``'s kernels ``names`` are recorded, not run."""
    launches = Launches()
    originals = {name: getattr(module, name) for name in names}
    try:
        for name, kernel in originals.items():
            setattr(module, name, _Recorder(kernel, launches))
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


def unlike(key: tuple, others: set[tuple]) -> str:
    """What sets ``key`` apart from the nearest of ``others`` (same kernel): for a failure message."""
    same_kernel = [o for o in others if o[0] == key[0]]
    if not same_kernel:
        return f"{key[0]}: never launched before"

    def differences(other):
        diffs = [f"{name}={value!r} (had {dict(other[1]).get(name)!r})" for name, value in key[1]
                 if dict(other[1]).get(name) != value]
        diffs += [f"{name}: {spec} (had {dict(other[2]).get(name)})" for name, spec in key[2]
                  if dict(other[2]).get(name) != spec]
        if key[3] != other[3]:
            diffs.append(f"options {key[3]} (had {other[3]})")
        return diffs

    nearest = min((differences(o) for o in same_kernel), key=len)
    return f"{key[0]}: " + ", ".join(nearest)
