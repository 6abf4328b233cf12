"""Steps with prompt chunks as CUDA graphs, captured piecewise around the attention.

A step that carries prompt chunks (a colocated worker's mixed step: decode rows first, then
chunks) runs its GEMMs over a few thousand tokens. Run eagerly, it launches about 15 kernels
per layer from Python, and the host's launch work (tens of microseconds a kernel) adds up to
more than a third of the step on an H200. Everything but the attention depends only on the
step's token count, so it is captured once per token-count bucket; the attention, whose grid
and metadata depend on how the tokens split into sequences, runs eagerly between the pieces:

    piece 0       embed, first norm, layer 0's QKV projection, rotary + K/V write
    attention 0   (eager) decode rows: decode kernel; chunks: prefill kernel
    piece i       layer i-1's o_proj + add + norm, MLP + add + norm; layer i's QKV, rotary + K/V write
    ...
    piece L       layer L-1's o_proj and MLP, the final norm

Pieces talk through static buffers sized for the largest bucket (input ids, positions, slots;
q, k, v, the residual stream, the attention output, the final hidden states): each piece reads
them and copies its outputs into them, so a piece's temporaries die inside it and every piece
of every bucket shares one memory pool (they replay one after another on one stream, in the
order they were captured). A step of T tokens replays the smallest bucket >= T with the rows
past T padded: slot -1 (their K/V is not written), stale token ids and positions (valid ones),
and their outputs never read: every kernel of a piece treats rows independently (activations
are quantized per token), so padding changes no real row.

Steps with LoRA adapter rows, steps larger than the largest bucket and steps that want every
token's hidden state (prompt logprobs) run eagerly.
"""

from __future__ import annotations

import torch

from tandem.engine.attention import SeqChunk
from tandem.engine.step_tokens import TokenFeed
from tandem.kernels import ops


def token_buckets(max_num_tokens: int) -> list[int]:
    """Multiples of 256 tokens up to 2,048, then of 1,024, and ``max_num_tokens`` (the largest)."""
    buckets, size = [], 256
    while size < max_num_tokens:
        buckets.append(size)
        size += 256 if size < 2048 else 1024
    return buckets + [max_num_tokens]


class MixedGraphs:
    def __init__(self, runner, max_num_tokens: int):
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.buckets = token_buckets(max_num_tokens)
        config, device, dtype = runner.config, runner.device, runner.dtype
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros(n, config.num_q_heads, config.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, config.num_kv_heads, config.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros(n, config.num_q_heads * config.head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(n, config.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros_like(self.residual)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._capture_all()

    def can_run(self, chunks: list[SeqChunk]) -> bool:
        return (sum(len(c.token_ids) for c in chunks) <= self.buckets[-1]
                and all(c.lora_slot < 0 for c in chunks))

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def forward(self, chunks: list[SeqChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """-> [B, vocab] fp32 logits of each chunk's last new token; writes the chunks' K/V
        (``ModelRunner.forward``)."""
        runner = self.runner
        meta = runner.metadata(chunks)
        num_tokens = meta.num_tokens
        bucket = self.bucket(num_tokens)
        self.input_ids[:num_tokens].copy_(runner.input_ids(chunks, feed))
        self.positions[:num_tokens].copy_(meta.positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:bucket].fill_(-1)
        graphs, layers, pool = self._graphs[bucket], runner.model.layers, runner.kv_pool
        q, k, v = self.q[:num_tokens], self.k[:num_tokens], self.v[:num_tokens]
        out = self.attn[:num_tokens].view(q.shape)
        graphs[0].replay()
        for layer, graph in zip(layers, graphs[1:]):
            layer.attend(q, k, v, pool, meta, out=out)
            graph.replay()
        return runner.model.compute_logits(self.hidden[meta.logits_indices])

    # ---- capture --------------------------------------------------------------------
    def _piece(self, index: int, size: int) -> None:
        """Piece ``index`` (module docstring) over the first ``size`` rows of the static buffers."""
        model = self.runner.model
        layers, eps = model.layers, self.runner.config.rms_norm_eps
        qkv = model.qkv_weights()  # what each norm hands an FP8 qkv projection comes quantized (model.forward)
        if index == 0:
            hidden = model.embed_tokens(self.input_ids[:size])
            hidden, residual = ops.fused_add_rms_norm(hidden, None, layers[0].input_layernorm, eps,
                                                      quantize_for=qkv[0])
        else:
            next_norm = layers[index].input_layernorm if index < len(layers) else model.norm
            hidden, residual = layers[index - 1].after_attention(self.attn[:size], self.residual[:size], next_norm,
                                                                 next_qkv=qkv[index])
        if index == len(layers):
            self.hidden[:size].copy_(hidden)
            return
        self.residual[:size].copy_(residual)
        layer = layers[index]
        q, k, v = layer.project_qkv(hidden)
        q, k = layer.rotary_kv_write(q, k, v, self.positions[:size], model.cos_sin_cache, self.runner.kv_pool,
                                     self.slot_mapping[:size])
        self.q[:size].copy_(q)
        self.k[:size].copy_(k)
        self.v[:size].copy_(v)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        num_pieces = len(self.runner.model.layers) + 1
        side = torch.cuda.Stream(device=self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile every kernel and pick every GEMM before capture
            for size in self.buckets:  # slots are -1: nothing is written to the cache
                for index in range(num_pieces):
                    self._piece(index, size)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            graphs = []
            for index in range(num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(index, size)
                graphs.append(graph)
            self._graphs[size] = graphs
        torch.cuda.synchronize()
