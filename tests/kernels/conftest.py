"""Kernel tests: on a machine without CUDA the Triton kernels run in the
interpreter on CPU tensors. TRITON_INTERPRET is read when a kernel is
decorated, so it is set here, before any kernel module is imported."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(autouse=True)
def _seeded():
    """Each kernel test draws its random inputs from one seed (TANDEM_TEST_SEED, default 0), so a
    CI failure reproduces; another seed checks that no test passes only by its draw."""
    torch.manual_seed(int(os.environ.get("TANDEM_TEST_SEED", "0")))
