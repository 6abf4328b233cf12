"""`tandem bench engine` measures the GPU path: without a CUDA device it says so and exits 2."""

import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_engine_without_cuda_is_refused_clearly():
    done = subprocess.run([sys.executable, "-m", "tandem.bench.engine"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "Traceback" not in done.stderr
