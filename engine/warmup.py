"""Compile the prefill kernels' variants, and a mixed step's attention variants, before the
first request.

The prefill attention kernel picks its query tile (16, 32, 64 or, for head
dims below 128, 128 rows) from the batch's mean query length, and the skinny GEMM its row tile
from the step's tokens (up to 128); each tile is a separate Triton compilation, a second or
more each. Without a warm-up, the first batches of
real traffic pay for them (measured on an H200: 8192-token prefill batches
taking 1-2 s instead of ~0.2 s in the first seconds of a benchmark). The KV
handoff's block gather and scatter kernels (tandem.kernels.block_copy, run by the
cuda_ipc and NCCL transports after the first chunk) are compiled here too: the
first request's prefill step took 446 ms for 445 tokens without them (one H200,
2026-11-30, at ecd6a75: `python3 -m tandem.bench.cluster_mixed --skip-hf`, then
`python3 -m tandem.bench.cluster_timeline` on its cluster.log; docs/kernels.md).

A step with prompt chunks (one device running both pools) runs its attention eagerly between
its CUDA-graph pieces (``engine.mixed_graph``); its decode rows' attention picks its launch
(KV splits, tile, warps: ``kernels.decode_config``) from the number of rows and the longest
context, so each form of that launch is a compilation of its own. The first mixed steps of a
256-stream run on a fresh machine took 0.7-1.3 s each where they take ~50 ms (one H100,
2026-12-06, `OFFLINE_RUNS=c256 bash scripts/gpu.sh offline`, the worker's statistics):
``warm_up_mixed`` runs one mixed step per form (``ops.decode_attention_variants``) before
traffic. The attention kernels are compiled for every value of what varies from step to step
(table widths, split and sequence counts, where a slice of the step's arrays starts), so their
forms are all there is; ``tests/engine/test_warm_up_coverage.py`` runs random steps of each
benchmark shape against the warm-up's launches.
"""

from __future__ import annotations

import time

import structlog
import torch

from tandem.cluster.sampling import SamplingParams
from tandem.engine import logits_process
from tandem.engine.attention import SeqChunk
from tandem.engine.device_copy import tensor_on
from tandem.engine.lora_weights import PROJECTION_TARGETS
from tandem.kernels import ops

log = structlog.get_logger(__name__)

# One forward of each token count: one token (the GEMV and the decode kernel), then one per
# query tile size of the prefill attention and per row tile of the skinny GEMM (16, 32, 64, 128
# rows), and past the skinny GEMM's rows
QUERY_LENGTHS = (1, 16, 32, 64, 128, 256)


def warm_up_prefill(runner, allocator, max_num_tokens: int, force: bool = False) -> float:
    """Run one forward per token count (``QUERY_LENGTHS``) on scratch blocks, gathering then
    scattering those blocks in place (the handoff's kernels), and with LoRA slots the same
    forwards with adapter rows (``warm_up_adapters``); -> seconds spent (0 off CUDA unless
    ``force``)."""
    if runner.device.type != "cuda" and not force:
        return 0.0
    started = time.perf_counter()

    def handoff_copies(blocks):
        kv = runner.kv_pool.kv
        ids = tensor_on(blocks, kv.device)
        ops.scatter_blocks(kv, ids, ops.gather_blocks(kv, ids))  # in place: the blocks keep their data

    _token_count_forwards(runner, allocator, max_num_tokens, after=handoff_copies)
    warm_up_logits(runner)
    warm_up_adapters(runner, allocator, max_num_tokens, force)
    if torch.cuda.is_available():
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - started
    log.info("prefill kernels warmed up", seconds=round(seconds, 2))
    return seconds


def warm_up_logits(runner) -> int:
    """The logits of 1 .. ``ops.SKINNY_GEMM_ROWS_LIMIT`` rows (the skinny GEMM's most; past it
    cuBLAS, which compiles nothing): a step's logits are one row per sequence, so their count is
    not its tokens', and the warm-up's forwards (one sequence each) never launch lm_head's row
    tiles. With FP8 projections nothing else launches the model-dtype skinny GEMM either
    (``tests/engine/test_warm_up_coverage.py``: a step of 17-32 sequences compiled one). -> the
    most rows run."""
    runner.warm_up_logits(ops.SKINNY_GEMM_ROWS_LIMIT)
    return ops.SKINNY_GEMM_ROWS_LIMIT


def _token_count_forwards(runner, allocator, max_num_tokens: int, lora_slot: int = -1, after=None) -> int:
    """One forward of each of ``QUERY_LENGTHS`` tokens (capped by the budget, as far as the free
    blocks reach), every token carrying ``lora_slot``, on scratch blocks given back after it
    (``after(blocks)`` first) -> the forwards run."""
    forwards = 0
    for q_len in sorted({min(n, max_num_tokens) for n in QUERY_LENGTHS}):
        if allocator.num_free * allocator.block_size < q_len:
            break
        blocks = allocator.allocate(q_len)
        try:
            runner.forward([SeqChunk([1] * q_len, 0, blocks, lora_slot=lora_slot)])
            if after is not None:
                after(blocks)
            forwards += 1
        finally:
            allocator.free(blocks)
    return forwards


def warm_up_penalties(runner, force: bool = False) -> bool:
    """Run the penalties' path once (``logits_process.first_token`` on a scratch row with a
    repetition penalty): its kernel is one binary for any batch, compiled here rather than in the
    step of the first request that asks for a penalty; -> whether it ran (not off CUDA unless
    ``force``)."""
    if runner.device.type != "cuda" and not force:
        return False
    logits = torch.zeros(1, runner.config.vocab_size, dtype=torch.float32, device=runner.device)
    logits_process.first_token(logits, [SamplingParams(repetition_penalty=1.1)], [[0]])
    return True


def warm_up_adapters(runner, allocator, max_num_tokens: int, force: bool = False) -> int:
    """With LoRA slots (``warm_up_prefill`` runs it): its forwards again, every token an adapter row (an
    empty slot holding a zero adapter of every projection, ``LoraWeights.zero_adapter``), since a
    step with adapter rows runs eagerly, its projections apart from their fused norms, and the
    LoRA kernels pick their row tile from the adapter rows; then once more with an adapter of
    neither o nor down, whose norms then add no LoRA (kernels.lora_rows) but keep their values;
    -> the forwards run (0 off CUDA unless ``force``, without LoRA slots, or with every slot
    holding an adapter)."""
    if (runner.device.type != "cuda" and not force) or runner.lora is None:
        return 0
    weights = runner.lora.weights
    slot = next((s for s in range(weights.max_loras) if not weights.occupied(s)), None)
    if slot is None:
        log.warning("no empty LoRA slot: adapter steps' kernels compile on first use")
        return 0
    forwards = 0
    for targets in (PROJECTION_TARGETS, set(PROJECTION_TARGETS) - {"o_proj", "down_proj"}):
        with weights.zero_adapter(slot, targets):
            forwards += _token_count_forwards(runner, allocator, max_num_tokens, lora_slot=slot)
    log.info("adapter steps warmed up", forwards=forwards)
    return forwards


def warm_up_mixed(runner, allocator, max_batch_size: int, max_seq_len: int, max_num_tokens: int,
                  force: bool = False) -> int:
    """Run a mixed step (decode rows and one prompt chunk) for each form of the decode rows'
    attention launch (``ops.decode_attention_variants``: rows 1 .. ``max_batch_size``, block
    tables as wide as ``max_seq_len`` or as far as the free blocks reach, each layer's window), on
    scratch blocks every row shares; -> the steps run (0 off CUDA unless ``force``). Every block
    is free again after."""
    if runner.device.type != "cuda" and not force:
        return 0
    started = time.perf_counter()
    block = allocator.block_size
    chunk_len = min(16, block)
    longest = min(max_seq_len, (allocator.num_free - 1) * block)  # one sequence, and the chunk's block
    max_rows = min(max_batch_size, max_num_tokens - chunk_len)
    if longest < 2 or max_rows < 1:
        return 0
    k_cache, _ = runner.kv_pool.layer(0)
    config = runner.config
    shapes: set[tuple[int, int]] = set()
    for window in {config.layer_sliding_window(i) for i in range(config.num_layers)}:
        variants = ops.decode_attention_variants(max_rows, -(-longest // block), runner.dtype, k_cache, window)
        shapes.update(variants.values())
    blocks = allocator.allocate(longest)
    chunk_blocks = allocator.allocate(chunk_len)
    steps = 0
    try:
        for num_rows, width in sorted(shapes):  # the rows read the same blocks; they write one scratch slot
            context = min(width * block, longest)
            decode = [SeqChunk([1], context - 1, blocks[:width]) for _ in range(num_rows)]
            runner.forward(decode + [SeqChunk([1] * chunk_len, 0, chunk_blocks)])
            steps += 1
    finally:
        allocator.free(chunk_blocks)
        allocator.free(blocks)
    if torch.cuda.is_available():
        torch.cuda.synchronize(runner.device)
    log.info("mixed steps warmed up", steps=steps, seconds=round(time.perf_counter() - started, 2))
    return steps
