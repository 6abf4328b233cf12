"""Compile the prefill kernels' variants before the first request.

The prefill attention kernel picks its query tile (16, 32, 64 or, for head
dims below 128, 128 rows) from the batch's mean query length; each tile is a separate Triton
compilation, a second or more each. Without a warm-up, the first batches of
real traffic pay for them (measured on an H200: 8192-token prefill batches
taking 1-2 s instead of ~0.2 s in the first seconds of a benchmark). The KV
handoff's block gather and scatter kernels (tandem.kernels.block_copy, run by the
cuda_ipc and NCCL transports after the first chunk) are compiled here too: the
first request's prefill step took 446 ms for 445 tokens without them (one H200,
2026-11-30, at ecd6a75: `python3 -m tandem.bench.cluster_mixed --skip-hf`, then
`python3 -m tandem.bench.cluster_timeline` on its cluster.log; docs/kernels.md).
"""

from __future__ import annotations

import time

import structlog
import torch

from tandem.engine.attention import SeqChunk
from tandem.kernels import ops

log = structlog.get_logger(__name__)

QUERY_LENGTHS = (16, 32, 64, 256)  # one per query tile size


def warm_up_prefill(runner, allocator, max_num_tokens: int) -> float:
    """Run one forward per query tile size on scratch blocks, and gather then scatter those
    blocks in place (the handoff's kernels); -> seconds spent (0 off CUDA)."""
    if runner.device.type != "cuda":
        return 0.0
    started = time.perf_counter()
    for q_len in sorted({min(n, max_num_tokens) for n in QUERY_LENGTHS}):
        if allocator.num_free * allocator.block_size < q_len:
            break
        blocks = allocator.allocate(q_len)
        try:
            runner.forward([SeqChunk([1] * q_len, 0, blocks)])
            kv = runner.kv_pool.kv
            ids = torch.tensor(blocks, dtype=torch.long, device=kv.device)
            ops.scatter_blocks(kv, ids, ops.gather_blocks(kv, ids))  # in place: the blocks keep their data
        finally:
            allocator.free(blocks)
    if torch.cuda.is_available():
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - started
    log.info("prefill kernels warmed up", seconds=round(seconds, 2))
    return seconds
