"""ModelRunner: the model, its KV pool and its rotary table, run one forward at a time.

Schedulers hand it ``SeqChunk``s (which tokens, which blocks); it returns the
logits of each sequence's last new token (``forward_hidden``: and the final hidden
states of every new token, for prompt logprobs). Block ownership stays with the
caller's allocator: the runner only reads and writes the blocks it is given.

The KV pool holds the model's dtype, or with ``kv_cache_dtype="fp8"`` E4M3 codes under
per-layer, per-head scales (``tandem.engine.kv_scales``: the checkpoint's, else calibrated).

LoRA (``enable_lora``): a chunk's ``lora_slot`` names the device slot of its adapter (the
``LoraManager``'s ``slots_for`` gives them); rows of several adapters and of the base model mix
in one forward. Decode steps with adapter rows replay CUDA graphs of their own
(``engine.cuda_graph``); steps with prompt chunks and adapter rows run eagerly.

Tensor parallelism (``tp``, ``engine.tensor_parallel``): the runner of a split model's leader
sends each forward's step, once checked, to its followers, and each follower runs it (``follow``).

CUDA graphs: decode steps (``enable_cuda_graphs``: whole steps per batch-size bucket) and steps
with prompt chunks (``enable_mixed_graphs``: per token-count bucket, captured piecewise around
the attention, which runs eagerly between the pieces); anything else runs eagerly.
"""

from __future__ import annotations

import os

import torch

from tandem.engine.attention import SeqChunk, build_input_ids, build_metadata, upload
from tandem.engine.kv_cache import KVCachePool, resolve_kv_dtype
from tandem.engine.kv_scales import kv_scales
from tandem.engine.loader import load_model
from tandem.engine.lora_batch import build_lora_batch
from tandem.engine.lora_manager import LoraManager
from tandem.engine.lora_weights import LoraWeights
from tandem.engine.step_tokens import TokenFeed, gather_fed


class ModelRunner:
    def __init__(
        self,
        model_path: str | os.PathLike,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_pool: KVCachePool | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``kv_cache_dtype`` (without ``kv_pool``): "auto" (the model's dtype) or "fp8"."""
        model, config = load_model(model_path, dtype=dtype, device=torch.device(device), quantization=quantization)
        self._setup(model, config, num_blocks, block_size, dtype, torch.device(device), kv_pool, kv_cache_dtype,
                    os.fspath(model_path))

    @classmethod
    def from_model(cls, model, config, num_blocks: int, block_size: int, kv_pool: KVCachePool | None = None,
                   kv_cache_dtype: str = "auto", tokenizer: str | None = None, tp=None):
        """A runner around a model already built (benchmarks with random weights); an FP8 pool's
        scales calibrated on ``tokenizer``'s tokens of the built-in text (none: fixed token ids).
        ``tp``: the ``engine.tensor_parallel.TPGroup`` whose rank's slice ``model`` is."""
        runner = cls.__new__(cls)
        weight = model.embed_tokens.weight
        runner._setup(model, config, num_blocks, block_size, weight.dtype, weight.device, kv_pool,
                      kv_cache_dtype, None, tokenizer)
        if tp is not None and tp.size > 1:
            runner.tp = tp
            model.set_tensor_parallel(tp)
        return runner

    def _setup(self, model, config, num_blocks, block_size, dtype, device, kv_pool, kv_cache_dtype="auto",
               model_path=None, tokenizer=None) -> None:
        self.device = device
        self.dtype = dtype
        self.model, self.config = model, config
        self.cos_sin_cache = self.model.cos_sin_cache  # [max_position, head_dim] fp32
        if kv_pool is None:
            kv_dtype = resolve_kv_dtype(kv_cache_dtype, dtype)
            k_scale = v_scale = None
            if kv_dtype != dtype:  # FP8: the checkpoint's scales, else calibrated on this model
                k_scale, v_scale = kv_scales(model, config, model_path, tokenizer or model_path, device, dtype)
            kv_pool = KVCachePool(
                self.config.num_layers, num_blocks, block_size, self.config.num_kv_heads,
                self.config.head_dim, kv_dtype, self.device, k_scale=k_scale, v_scale=v_scale,
            )
        self._check_pool(kv_pool, block_size)
        self.kv_pool = kv_pool
        self.block_size = kv_pool.block_size
        self.num_blocks = kv_pool.num_blocks
        self.graphs = None  # engine.cuda_graph.DecodeGraphs once enable_cuda_graphs() ran
        self.mixed_graphs = None  # engine.mixed_graph.MixedGraphs once enable_mixed_graphs() ran
        self.lora: LoraManager | None = None  # once enable_lora() ran
        self.tp = None  # engine.tensor_parallel.TPGroup: this runner is one rank of a split model
        self.rank_pools: list[KVCachePool] = []  # a split model's leader: its followers' pools, mapped

    def enable_lora(self, max_loras: int, max_rank: int, max_cpu_loras: int | None = None,
                    weights: LoraWeights | None = None, fuse: bool | None = None) -> LoraManager:
        """Device slots for ``max_loras`` adapters of rank up to ``max_rank`` (their memory is taken
        now, or was: ``weights``, allocated before the KV pool was sized) and a host cache of
        ``max_cpu_loras`` (default: ``max_loras``) -> the manager that loads adapters and hands
        out their slots. The A stacks go under the model's weights where ``LoraWeights.fuse_into``
        puts them (``fuse`` as its ``force``; a split model's stay apart)."""
        if self.lora is not None:
            raise ValueError("LoRA is already enabled on this runner")
        if self.graphs is not None or self.mixed_graphs is not None:
            raise ValueError("enable LoRA before CUDA graphs: the decode graphs capture the adapter slots")
        if weights is None:
            weights = LoraWeights(self.config, max_loras, max_rank, self.dtype, self.device)
        if self.tp is None:
            weights.fuse_into(self.model, fuse)
        self.lora = LoraManager(weights, self.config, max_cpu_loras or max_loras)
        return self.lora

    def enable_cuda_graphs(self, max_batch_size: int, max_seq_len: int) -> None:
        """Capture decode steps per batch-size bucket (CUDA only; eager above the largest bucket)."""
        from tandem.engine.cuda_graph import DecodeGraphs

        if self.tp is not None:
            return  # a split model's steps run eagerly: their collectives are not captured
        self.graphs = DecodeGraphs(self, max_batch_size, max_seq_len)

    def enable_mixed_graphs(self, max_num_tokens: int) -> None:
        """Capture steps with prompt chunks (and any decode rows) of up to ``max_num_tokens`` tokens,
        piecewise around their attention (CUDA only; ``engine.mixed_graph``)."""
        from tandem.engine.mixed_graph import MixedGraphs

        if self.tp is not None:
            return
        self.mixed_graphs = MixedGraphs(self, max_num_tokens)

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """-> [B, vocab] fp32 logits of each chunk's last new token; writes the chunks' K/V.

        ``feed``: the leading chunks' input tokens as the previous step sampled them on the device
        (decode rows, one token each; their chunks' own token ids are ignored). A step may carry
        prompt chunks after its decode rows (a mixed step: the decode rows take the decode
        attention, the chunks the prefill attention); the feed covers the decode rows only.
        """
        self._check_feed(chunks, feed)
        if self.graphs is not None and self.graphs.can_run(chunks):
            return self.graphs.forward(chunks, feed)
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(chunks):
            return self.mixed_graphs.forward(chunks, feed)
        hidden, meta = self._hidden(chunks, feed)
        return self.model.compute_logits(hidden[meta.logits_indices])  # [B, vocab]

    @torch.inference_mode()
    def forward_hidden(self, chunks: list[SeqChunk], feed: TokenFeed | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [B, vocab] of each chunk's last new token, as ``forward``; final-normed hidden
        states [T, hidden] of every new token, the chunks' tokens in order). A prompt's own
        logprobs are computed from the latter (``tandem.engine.prompt_logprobs``); never a CUDA graph."""
        self._check_feed(chunks, feed)
        hidden, meta = self._hidden(chunks, feed)
        return self.model.compute_logits(hidden[meta.logits_indices]), hidden

    def attach_rank_pools(self, pools: list[KVCachePool]) -> None:
        """The leader of a split model: its followers' pools (ranks 1..N-1, mapped from their files)."""
        self.rank_pools = list(pools)

    def handoff_kv(self):
        """What a KV handoff reads: the pool's tensor; with followers' pools mapped, the KV of every
        head as (a pool's tensor, the first KV head it holds), one per rank (``kvtransfer.shm``)."""
        if not self.rank_pools:
            return self.kv_pool.kv
        heads = self.kv_pool.num_kv_heads
        return [(pool.kv, rank * heads) for rank, pool in enumerate([self.kv_pool, *self.rank_pools])]

    def leave_group(self) -> None:
        """The leader of a split model: its followers stop and the group closes (at the worker's end)."""
        if self.tp is not None:
            tp, self.tp = self.tp, None
            tp.stop()
            tp.close()
        for pool in self.rank_pools:
            pool.close()
        self.rank_pools = []

    @torch.inference_mode()
    def follow(self) -> None:
        """A follower rank of a split model: run each forward its leader runs, until it stops
        (``engine.tensor_parallel``). Logits are the leader's: none are computed here. The leader
        sends only steps it has checked (``_hidden``), so an error here is this rank's own: it
        ends the process, and with it the worker."""
        while (step := self.tp.receive()) is not None:
            chunks, feed = step
            self._hidden(chunks, feed)

    def _check_feed(self, chunks: list[SeqChunk], feed: TokenFeed | None) -> None:
        if feed is None:
            return
        if len(feed.rows) > len(chunks):
            raise ValueError(f"token feed has {len(feed.rows)} rows for a step of {len(chunks)}")
        feed.check(len(feed.rows))
        if any(len(chunk.token_ids) != 1 for chunk in chunks[: len(feed.rows)]):
            raise ValueError("a token feed needs one new token per fed chunk (decode rows)")
        if feed.tokens.device.type != self.device.type:
            raise ValueError(f"fed tokens are on {feed.tokens.device}, the model on {self.device}")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] final-normed states -> [N, vocab] fp32 logits."""
        with torch.inference_mode():
            return self.model.compute_logits(hidden)

    def warm_up_logits(self, max_rows: int) -> None:
        """The logits of 1 .. ``max_rows`` rows of zeros (``engine.warmup.warm_up_logits``)."""
        hidden = torch.zeros(max_rows, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for rows in range(1, max_rows + 1):
            self.compute_logits(hidden[:rows])

    def _hidden(self, chunks: list[SeqChunk], feed: TokenFeed | None):
        """-> (final-normed hidden states [T, hidden], the step's metadata). The leader of a split
        model (every forward of which comes here: its steps run eagerly) sends the step to its
        followers once it passed the checks, so a refused step never reaches them."""
        meta = self.metadata(chunks)
        if self.tp is not None and self.tp.is_leader:
            self.tp.lead(chunks, feed)
        meta.lora = build_lora_batch([(chunk.lora_slot, len(chunk.token_ids)) for chunk in chunks],
                                     None if self.lora is None else self.lora.weights, self.device)
        return self.model(self.input_ids(chunks, feed), meta.positions, self.kv_pool, meta), meta  # [T, hidden]

    def metadata(self, chunks: list[SeqChunk]):
        """The step's ``AttentionMetadata`` on the device; refuses chunks that are malformed or
        reach past the rotary table."""
        meta = build_metadata(chunks, self.block_size, self.device)  # validates the chunks
        longest = max(chunk.seq_len for chunk in chunks)
        if longest > self.max_position:
            raise ValueError(f"a sequence reaches {longest} tokens, beyond the rotary table's {self.max_position}")
        return meta

    def input_ids(self, chunks: list[SeqChunk], feed: TokenFeed | None) -> torch.Tensor:
        """-> [T] int64 on the device: the chunks' new tokens, the fed rows' from ``feed``."""
        input_ids = build_input_ids(chunks, self.device)
        if feed is not None:  # the fed rows lead, one token each: row i is token i
            src = upload([feed.rows + [-1] * (input_ids.shape[0] - len(feed.rows))], self.device)[0]
            gather_fed(input_ids, src, feed.tokens)
        return input_ids

    def _check_pool(self, pool: KVCachePool, block_size: int) -> None:
        want = (self.config.num_layers, block_size, self.config.num_kv_heads, self.config.head_dim, self.dtype)
        have = (pool.num_layers, pool.block_size, pool.num_kv_heads, pool.head_dim, pool.dtype)
        if want[:4] != have[:4] or (pool.dtype != self.dtype and not pool.is_fp8):
            raise ValueError(
                f"KV pool (layers, block_size, kv_heads, head_dim, dtype)={have} does not fit the model's {want} "
                "(or an FP8 pool)"
            )
        if pool.is_fp8 and pool.k_scale is None:
            raise ValueError("an FP8 KV pool needs its k_scale and v_scale (tandem.engine.kv_scales)")
        have_dev = pool.kv.device
        if have_dev.type != self.device.type or self.device.index not in (None, have_dev.index):
            raise ValueError(f"KV pool is on {pool.kv.device} but the model on {self.device}")
