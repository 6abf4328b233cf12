"""Decode steps as CUDA graphs, one per batch-size bucket.

A decode step launches hundreds of small kernels; replaying a captured graph
costs one launch. Inputs live in static device buffers sized for the largest
bucket; a batch of B sequences runs the graph of the smallest bucket >= B with
the rows past B padded: slot -1 (the KV write skips it), seq_len 1 and block
table row 0, so the padded rows read one harmless slot (which a real row may be
writing in the same launch: the padded output is never used) and their logits
are dropped. Batches larger than the largest bucket and prefill chunks run eagerly. All
graphs share one memory pool, captured largest first.

LoRA (a runner with adapter slots): each bucket has a second graph whose forward adds every
projection's LoRA (engine.lora_batch) through static segment buffers: ``lora_order`` lists
the adapter rows slot by slot, ``lora_starts`` [max_loras + 1] where each slot's run begins,
``lora_slots`` [max_loras] its slot, unused segments empty with slot -1, and ``row_slots``
[rows] every row's slot (-1: none, padded rows too). The LoRA kernels'
grids depend on the bucket and ``max_loras`` only (programs past their segment's end
return), so one capture serves any split of the rows among adapters. A projection no row's
adapter targets is zero in every slot (engine.lora_weights) and adds nothing. A step without
adapter rows replays the base graph.

Block-table rows are written into pinned host memory through a numpy view and
copied in one strided copy covering only the columns this batch uses: stale
entries beyond a row's length are never read (the kernels stop at seq_len).
The pinned staging is double-buffered: steps run back to back (``TokenFeed``),
so the host fills one buffer while the previous step's copies may still be
queued from the other; an event guards each buffer's reuse.
"""

from __future__ import annotations

import torch

from tandem.engine.attention import AttentionMetadata, SeqChunk
from tandem.engine.lora_batch import LoraBatch, rows_by_slot
from tandem.engine.lora_weights import PROJECTION_TARGETS
from tandem.engine.step_tokens import TokenFeed, gather_fed

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def buckets_for(max_batch_size: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch_size] + [max_batch_size]


class DecodeGraphs:
    def __init__(self, runner, max_batch_size: int, max_seq_len: int):
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.buckets = buckets_for(max_batch_size)
        self.max_blocks = -(-max_seq_len // runner.block_size)
        n, device = self.buckets[-1], runner.device
        # static device inputs, [n] or [n, max_blocks]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.feed_src = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.lora_weights = None if runner.lora is None else runner.lora.weights
        num_loras = 0 if self.lora_weights is None else self.lora_weights.max_loras
        # static LoRA segments (module docstring): [order (n) | starts (num_loras + 1) | slots (num_loras) |
        # row slots (n)]
        self.lora_segments = torch.zeros(2 * n + 2 * num_loras + 1, dtype=torch.int64, device=device)
        self.lora_segments[n + 2 * num_loras + 1:] = -1  # the captures' rows carry no adapter
        self._staging = [_Staging(n, self.max_blocks, num_loras, device) for _ in range(2)]
        self._turn = 0
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, bool], torch.Tensor] = {}
        self._capture_all()

    def can_run(self, chunks: list[SeqChunk]) -> bool:
        return (
            len(chunks) <= self.buckets[-1]
            and all(len(c.token_ids) == 1 and len(c.block_ids) <= self.max_blocks for c in chunks)
            and (self.lora_weights is not None or all(c.lora_slot < 0 for c in chunks))
        )

    def forward(self, chunks: list[SeqChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """-> [B, vocab] fp32 logits; writes each sequence's new K/V. ``feed``: see ``ModelRunner.forward``."""
        num_seqs = len(chunks)
        bucket = next(b for b in self.buckets if b >= num_seqs)
        block_size = self.runner.block_size
        stage = self._staging[self._turn]
        self._turn ^= 1
        stage.reusable()
        vec, lens, tables = stage.vec_np, stage.seq_lens_np, stage.tables_np
        width = 1
        for i, chunk in enumerate(chunks):
            pos = chunk.num_computed
            blocks = chunk.block_ids
            vec[0, i] = chunk.token_ids[0]
            vec[1, i] = pos
            vec[2, i] = blocks[pos // block_size] * block_size + pos % block_size
            lens[i] = pos + 1
            used = pos // block_size + 1
            tables[i, :used] = blocks[:used]
            width = max(width, used)
        vec[:2, num_seqs:bucket] = 0
        vec[2, num_seqs:bucket] = -1
        lens[num_seqs:bucket] = 1
        tables[num_seqs:bucket, :width] = 0
        host_vec = stage.vec
        self.input_ids[:bucket].copy_(host_vec[0, :bucket], non_blocking=True)
        self.positions[:bucket].copy_(host_vec[1, :bucket], non_blocking=True)
        self.slot_mapping[:bucket].copy_(host_vec[2, :bucket], non_blocking=True)
        self.seq_lens[:bucket].copy_(stage.seq_lens[:bucket], non_blocking=True)
        self.block_tables[:bucket, :width].copy_(stage.tables[:bucket, :width], non_blocking=True)
        if feed is not None:
            vec[3, :num_seqs] = feed.rows
            vec[3, num_seqs:bucket] = -1
            self.feed_src[:bucket].copy_(host_vec[3, :bucket], non_blocking=True)
            gather_fed(self.input_ids[:bucket], self.feed_src[:bucket], feed.tokens)
        with_lora = self._stage_lora(chunks, stage)
        stage.copied()
        self._graphs[bucket, with_lora].replay()
        # a copy: the static buffer is overwritten by the next replay
        return self._logits[bucket, with_lora][:num_seqs].clone()

    def _stage_lora(self, chunks: list[SeqChunk], stage: "_Staging") -> bool:
        """Fill the static LoRA segments for ``chunks`` -> whether any row carries an adapter."""
        if self.lora_weights is None or all(c.lora_slot < 0 for c in chunks):
            return False
        segments = list(rows_by_slot([(c.lora_slot, 1) for c in chunks], self.lora_weights).items())
        n, num_loras = self.buckets[-1], self.lora_weights.max_loras
        segs = stage.lora_np
        order, starts = segs[:n], segs[n:n + num_loras + 1]
        slots, row_slots = segs[n + num_loras + 1:n + 2 * num_loras + 1], segs[n + 2 * num_loras + 1:]
        starts[0] = at = 0
        row_slots[:] = -1
        for k in range(num_loras):  # the segments the step has, then empty ones of slot -1
            slot, rows = segments[k] if k < len(segments) else (-1, [])
            order[at:at + len(rows)] = rows
            row_slots[rows] = slot
            at += len(rows)
            slots[k], starts[k + 1] = slot, at
        self.lora_segments.copy_(stage.lora, non_blocking=True)
        return True

    def graph(self, bucket: int, with_lora: bool = False) -> torch.cuda.CUDAGraph:
        """The captured step of ``bucket`` rows (with_lora: the one adding the adapters' LoRA)."""
        return self._graphs[bucket, with_lora]

    # ---- capture --------------------------------------------------------------------
    def _metadata(self, bucket: int, with_lora: bool = False) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            positions=self.positions[:bucket],
            logits_indices=self.logits_indices[:bucket],
            is_decode=True,
        )
        if with_lora:
            n, num_loras = self.buckets[-1], self.lora_weights.max_loras
            segs = self.lora_segments
            meta.lora = LoraBatch(token_order=segs[:bucket], seg_starts=segs[n:n + num_loras + 1].to(torch.int32),
                                  seg_slots=segs[n + num_loras + 1:n + 2 * num_loras + 1].to(torch.int32),
                                  row_slots=segs[n + 2 * num_loras + 1:n + 2 * num_loras + 1 + bucket],
                                  weights=self.lora_weights,
                                  projections=frozenset(PROJECTION_TARGETS))
        return meta

    def _step(self, bucket: int, with_lora: bool = False) -> torch.Tensor:
        model = self.runner.model
        meta = self._metadata(bucket, with_lora)
        hidden = model(self.input_ids[:bucket], meta.positions, self.runner.kv_pool, meta)
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        kinds = [False] if self.lora_weights is None else [False, True]
        with torch.cuda.stream(side):
            for bucket in self.buckets:  # compile every Triton kernel before capture
                for with_lora in kinds:
                    self._step(bucket, with_lora)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for bucket in reversed(self.buckets):
            for with_lora in kinds:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._logits[bucket, with_lora] = self._step(bucket, with_lora)
                self._graphs[bucket, with_lora] = graph
        torch.cuda.synchronize()


class _Staging:
    """Pinned host inputs of one step: rows 0-3 of ``vec`` = input ids, positions, slots,
    feed sources (int64); seq_lens and block tables apart (int32); the LoRA segments (int64,
    ``DecodeGraphs.lora_segments``' layout)."""

    def __init__(self, n: int, max_blocks: int, num_loras: int, device: torch.device):
        self.device = device
        self.lora = torch.zeros(2 * n + 2 * num_loras + 1, dtype=torch.int64, pin_memory=True)
        self.lora_np = self.lora.numpy()
        self.vec = torch.zeros(4, n, dtype=torch.int64, pin_memory=True)
        self.seq_lens = torch.ones(n, dtype=torch.int32, pin_memory=True)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, pin_memory=True)
        self.vec_np, self.seq_lens_np, self.tables_np = self.vec.numpy(), self.seq_lens.numpy(), self.tables.numpy()
        self._copied: torch.cuda.Event | None = None

    def reusable(self) -> None:
        """Wait until the copies that last read this buffer have run (at once in steady state)."""
        if self._copied is not None:
            self._copied.synchronize()

    def copied(self) -> None:
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
