"""GPU timing helpers shared by the benchmarks."""

from __future__ import annotations

import time

import torch


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn`` on the GPU, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def graph_ms(calls) -> float:
    """ms per call of the zero-argument ``calls``, captured back to back in one CUDA graph and
    replayed: a Python launch can take longer than a small kernel, so launched one by one the
    launches would be timed. Each is run once outside the capture first (compile, warm-up)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay, reps=10, warmup=2) / len(calls)


def wall_s(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def ceilings() -> dict:
    """Measured HBM copy bandwidth (read + write) and bf16 matmul rate."""
    n = 1 << 30
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_ms = median_ms(lambda: b.copy_(a))
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: x @ y)
    del x, y
    torch.cuda.empty_cache()
    return {"hbm_copy_TBps": 2 * n * 2 / (copy_ms / 1e3) / 1e12, "bf16_matmul_TFLOPs": 2 * m**3 / (mm_ms / 1e3) / 1e12}


def fp8_matmul_TFLOPs(m: int = 8192) -> float:
    """The FP8 tensor-core rate: torch._scaled_mm of two m x m E4M3 matrices with row-wise scales
    (as FP8 weights' prefill runs it), bf16 out."""
    a = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, m, device="cuda")
    ms = median_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    del a, b
    torch.cuda.empty_cache()
    return 2 * m**3 / (ms / 1e3) / 1e12
