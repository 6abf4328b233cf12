"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a paged KV pool.

Every heavy op goes through ``tandem.kernels.ops`` (Triton on CUDA, torch reference
elsewhere); this module only does the matmuls and wiring. Weights are held
fused, as the loader writes them: ``qkv_proj`` = [q; k; v] and
``gate_up_proj`` = [gate; up], one matmul each.

Batches are flattened: T tokens of B sequences, no padding; where each
sequence's tokens sit and where their K/V go is in ``AttentionMetadata``.

With FP8 weights (``config.quantization == "fp8"``) each projection's ``weight`` is its
float8_e4m3fn rows and ``weight_scale`` (a buffer) their fp32 scales, handed to the ops
as one ``Fp8Weight``; embeddings, norms and lm_head stay in the model dtype.

A step whose rows carry LoRA adapters (``meta.lora``, engine.lora_batch) adds each adapter
row's LoRA to the projections' outputs before anything else reads them: the o and down
projections' LoRA in the residual add + norm after them, gate/up's in its SiLU·mul; where a
norm or the SiLU·mul hands an FP8 projection quantized rows that its LoRA reads in the model's
dtype (its A stacks apart from its weight: ``LoraBatch.needs_values``), it keeps their values too
(``fp8_weight.in_model_dtype``). A step without adapter rows runs exactly the base model's kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.attention import AttentionMetadata
from tandem.engine.config import ModelConfig
from tandem.engine.kv_cache import KVCachePool
from tandem.engine.lora_batch import LoraBatch
from tandem.kernels import ops
from tandem.kernels.fp8_weight import Fp8Weight

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a decoder layer's matmuls


def projection_weight(proj: nn.Linear) -> torch.Tensor | Fp8Weight:
    """A projection's weight as the ops take it: the tensor, or with FP8 weights its rows and scales."""
    scale = getattr(proj, "weight_scale", None)
    return proj.weight if scale is None else Fp8Weight(proj.weight, scale)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_q_heads = config.num_q_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.layer_sliding_window(layer_idx)
        q_size = config.num_q_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.tp = None  # engine.tensor_parallel.TPGroup of a model split over ranks (set_tensor_parallel)

        self.input_layernorm = nn.Parameter(torch.empty(config.hidden_size))
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.empty(config.hidden_size))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        if config.quantization == "fp8":  # each weight holds E4M3 rows; their scales are buffers
            for name in PROJECTIONS:
                proj = getattr(self, name)
                proj.register_buffer("weight_scale", torch.empty(proj.out_features, dtype=torch.float32))

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden], normed by this layer's input_layernorm
        residual: torch.Tensor,  # [T, hidden], the stream before that norm
        positions: torch.Tensor,  # [T]
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
        kv_pool: KVCachePool,
        meta: AttentionMetadata,
        next_norm: torch.Tensor,  # [hidden]: the next layer's input_layernorm, or the final norm
        next_qkv=None,  # the next layer's qkv weight (qkv_weight), None after the last layer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the stream after this layer normed by ``next_norm``, the stream). Each residual
        add and the norm after it are fused into the projection before them (kernels.ops)."""
        attn = self._attention(hidden, positions, cos_sin_cache, kv_pool, meta)  # [T, q_size]
        return self.after_attention(attn, residual, next_norm, meta.lora, next_qkv)

    def qkv_weight(self):
        return projection_weight(self.qkv_proj)

    def after_attention(self, attn, residual, next_norm, lora: LoraBatch | None = None, next_qkv=None):
        """From the attention's output [T, q_size] to (the stream after this layer normed by
        ``next_norm``, the stream): o_proj, its residual add and norm, the MLP, its add and norm.
        The hidden states each norm and the SiLU·mul hand to an FP8 projection come quantized
        where it would quantize them (``quantize_for``: kernels.ops.quantizes_input); the last
        norm's, for ``next_qkv`` (None: the stream out stays in the model's dtype)."""
        if lora is not None:
            return self._after_attention_with_lora(attn, residual, next_norm, lora, next_qkv)
        if self.tp is not None:
            return self._after_attention_split(attn, residual, next_norm)
        gate_up, down = projection_weight(self.gate_up_proj), projection_weight(self.down_proj)
        hidden, residual = ops.linear_add_rms_norm(attn, projection_weight(self.o_proj), residual,
                                                   self.post_attention_layernorm, self.eps, quantize_for=gate_up)
        act = ops.gate_up_silu_mul(hidden, gate_up, quantize_for=down)  # [T, intermediate]
        return ops.linear_add_rms_norm(act, down, residual, next_norm, self.eps, quantize_for=next_qkv)

    def _after_attention_split(self, attn, residual, next_norm):
        """The rest of ``forward`` on one rank of a split model: o_proj and down_proj are this rank's
        columns, their partial sums added across the ranks before each residual add."""
        out = ops.linear(attn, projection_weight(self.o_proj))
        self.tp.all_reduce(out)
        hidden, residual = ops.fused_add_rms_norm(out, residual, self.post_attention_layernorm, self.eps)
        act = ops.gate_up_silu_mul(hidden, projection_weight(self.gate_up_proj))  # [T, intermediate / ranks]
        out = ops.linear(act, projection_weight(self.down_proj))
        self.tp.all_reduce(out)
        return ops.fused_add_rms_norm(out, residual, next_norm, self.eps)

    def _after_attention_with_lora(self, attn, residual, next_norm, lora: LoraBatch, next_qkv=None):
        """The rest of ``forward`` with each projection's LoRA added to its output; the o and down
        projections' in the add-norm after them (kernels.lora_rows). A projection's input that comes
        quantized keeps its values in the model's dtype for the adapters."""
        gate_up_w, down_w = projection_weight(self.gate_up_proj), projection_weight(self.down_proj)
        layer = self.layer_idx
        hidden, residual = lora.linear_add_rms_norm("o_proj", layer, attn, projection_weight(self.o_proj), residual,
                                                    self.post_attention_layernorm, self.eps, quantize_for=gate_up_w,
                                                    keep_values=lora.needs_values("gate_up_proj", layer))
        act = lora.gate_up_silu_mul(layer, hidden, gate_up_w, quantize_for=down_w,
                                    keep_values=lora.needs_values("down_proj", layer))
        return lora.linear_add_rms_norm("down_proj", layer, act, down_w, residual, next_norm, self.eps,
                                        quantize_for=next_qkv, keep_values=lora.needs_values("qkv_proj", layer + 1))

    def project_qkv(self, hidden, lora: LoraBatch | None = None):
        """-> q [T, Hq, D], k and v [T, Hkv, D] (views of one projection), unrotated."""
        num_tokens = hidden.shape[0]
        weight = projection_weight(self.qkv_proj)
        if lora is None:
            qkv = ops.linear(hidden, weight, self.qkv_proj.bias)  # [T, (Hq + 2 Hkv) * D]
        else:
            qkv = lora.linear("qkv_proj", self.layer_idx, hidden, weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(num_tokens, self.num_q_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))

    def rotary_kv_write(self, q, k, v, positions, cos_sin_cache, kv_pool: KVCachePool, slot_mapping):
        """-> (q, k) rotated; the rotated k and v written to this layer's cache (slot -1: not written)."""
        k_cache, v_cache = kv_pool.layer(self.layer_idx)
        k_scale, v_scale = kv_pool.layer_scales(self.layer_idx)  # an FP8 pool's; None otherwise
        return ops.rotary_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k, v, kv_pool: KVCachePool, meta: AttentionMetadata, out: torch.Tensor | None = None):
        """Attention of rotated q (k, v: this forward's own keys and values, already in the cache)
        -> [T, Hq, D]: decode rows through the decode kernel, prompt chunks through the prefill
        kernel, a mixed step each part its own. ``out``: written there (and returned)."""
        k_cache, v_cache = kv_pool.layer(self.layer_idx)
        k_scale, v_scale = kv_pool.layer_scales(self.layer_idx)
        if meta.is_decode:
            result = ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                          self.sliding_window, k_scale, v_scale)
        elif meta.is_mixed:  # decode rows and prompt chunks in one step: each part its own kernel
            d = meta.num_decode
            parts = [
                ops.decode_attention(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.seq_lens[:d],
                                     self.scale, self.sliding_window, k_scale, v_scale),
                ops.prefill_attention(q[d:], k_cache, v_cache, meta.block_tables[d:], meta.prefill_query_start_loc,
                                      meta.seq_lens[d:], self.scale, self.sliding_window, chunk_kv=(k[d:], v[d:]),
                                      k_scale=k_scale, v_scale=v_scale),
            ]
            return torch.cat(parts) if out is None else torch.cat(parts, out=out)
        else:
            result = ops.prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                self.scale, self.sliding_window, chunk_kv=(k, v),  # the chunk's keys: contiguous reads
                k_scale=k_scale, v_scale=v_scale,
            )
        return result if out is None else out.copy_(result)

    def _attention(self, hidden, positions, cos_sin_cache, kv_pool: KVCachePool, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        q, k, v = self.project_qkv(hidden, meta.lora)
        if meta.is_decode and q.is_cuda and ops.fused_decode_rotary(num_tokens):
            k_cache, v_cache = kv_pool.layer(self.layer_idx)
            k_scale, v_scale = kv_pool.layer_scales(self.layer_idx)
            out = ops.decode_attention_new_token(
                q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                meta.seq_lens, self.scale, self.sliding_window, k_scale, v_scale,
            )
        else:
            q, k = self.rotary_kv_write(q, k, v, positions, cos_sin_cache, kv_pool, meta.slot_mapping)
            out = self.attend(q, k, v, kv_pool, meta)
        return out.reshape(num_tokens, self.q_size)


class LlamaFamilyModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size))
        # Tied checkpoints reuse the embedding matrix; no second copy is held.
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size)
        )
        # Filled by the loader/runner (``set_cos_sin_cache``); not a checkpoint tensor.
        self.register_buffer("cos_sin_cache", torch.empty(0, config.head_dim), persistent=False)

    def set_cos_sin_cache(self, cos_sin_cache: torch.Tensor) -> None:
        self.cos_sin_cache = cos_sin_cache  # [max_position, head_dim] fp32

    def set_tensor_parallel(self, group) -> None:
        """This model is one rank's slice (``engine.tensor_parallel``): its layers add their
        row-parallel projections' partial sums across ``group``."""
        for layer in self.layers:
            layer.tp = group

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_pool: KVCachePool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """-> [T, hidden], final-normed hidden states of every new token."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        first_norm = self.layers[0].input_layernorm if len(self.layers) else self.norm
        qkv = self.qkv_weights()
        keep = meta.lora is not None and meta.lora.needs_values("qkv_proj", 0)  # for the adapters' shrink
        hidden, residual = ops.fused_add_rms_norm(hidden, None, first_norm, self.config.rms_norm_eps,
                                                  quantize_for=qkv[0], keep_values=keep)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, kv_pool, meta, next_norm,
                                     qkv[i + 1])
        return hidden

    def qkv_weights(self) -> list:
        """Each layer's qkv weight, then None (the final norm's output stays in the model's dtype):
        what the norm before each takes as ``quantize_for``. All None for a split model (its layers'
        norms follow collectives, ``_after_attention_split``)."""
        if any(layer.tp is not None for layer in self.layers):
            return [None] * (len(self.layers) + 1)
        return [layer.qkv_weight() for layer in self.layers] + [None]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 (sampling wants fp32 whatever the model dtype)."""
        return ops.linear(hidden, self.lm_head_weight).float()
