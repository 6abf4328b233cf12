"""Compile the prefill kernels' variants before the first request.

The prefill attention kernel picks its query tile (16, 32, 64 or, for head
dims below 128, 128 rows) from the batch's mean query length; each tile is a separate Triton
compilation, a second or more each. Without a warm-up, the first batches of
real traffic pay for them (measured on an H200: 8192-token prefill batches
taking 1-2 s instead of ~0.2 s in the first seconds of a benchmark).
"""

from __future__ import annotations

import time

import structlog
import torch

from engine.attention import SeqChunk

log = structlog.get_logger(__name__)

QUERY_LENGTHS = (16, 32, 64, 256)  # one per query tile size


def warm_up_prefill(runner, allocator, max_num_tokens: int) -> float:
    """Run one forward per query tile size on scratch blocks; -> seconds spent (0 off CUDA)."""
    if runner.device.type != "cuda":
        return 0.0
    started = time.perf_counter()
    for q_len in sorted({min(n, max_num_tokens) for n in QUERY_LENGTHS}):
        if allocator.num_free * allocator.block_size < q_len:
            break
        blocks = allocator.allocate(q_len)
        try:
            runner.forward([SeqChunk([1] * q_len, 0, blocks)])
        finally:
            allocator.free(blocks)
    if torch.cuda.is_available():
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - started
    log.info("prefill kernels warmed up", seconds=round(seconds, 2))
    return seconds
