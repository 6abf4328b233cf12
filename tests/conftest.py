"""Suite-wide setup. Without CUDA the Triton kernels run in Triton's interpreter
on CPU tensors; TRITON_INTERPRET is read when a kernel module is imported, so it
is set here, before any test module can import one.

The suite runs in pytest-xdist workers (pyproject's addopts: at most two, a file's
tests in one worker). Each worker gets its share of the cores for torch's threads,
and the processes its tests start (workers of a local cluster) inherit that bound
through OMP_NUM_THREADS: a CPU test's threads otherwise spin against the other
worker's and its cluster's.

tandem is imported first: pytest puts the repository root on sys.path (to import tests/),
and tandem's import guard keeps the root's folders (kernels/, engine/, ...) from being
found as top-level modules by what the tests import (transformers imports the PyPI
package `kernels`)."""

import tandem  # noqa: F401  (first: tandem.import_guard)

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and not torch.cuda.is_available():
    _threads = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(min(torch.get_num_threads(), int(os.environ["OMP_NUM_THREADS"])))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _kernel_switches_from_the_environment():
    """Each test starts and ends with the kernel tuning switches its environment sets
    (tandem.kernels.switches reads them once per process otherwise)."""
    from tandem.kernels import switches

    switches.current.cache_clear()
    yield
    switches.current.cache_clear()
