"""Torch reference implementations of every kernel: the contract.

These are the CPU serving path and the ground truth the Triton kernels are
tested against. Every Triton kernel in this package has exactly the signature
of its reference here.

Layouts used throughout:
    q            [num_tokens, num_q_heads, head_dim]
    k, v         [num_tokens, num_kv_heads, head_dim]
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim]  (one layer)
    kv_pool      [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping [num_tokens] int64, slot = block_id * block_size + offset, -1 = skip
    block_tables [num_seqs, max_blocks_per_seq] int32 (unused entries arbitrary)
    query_start_loc [num_seqs + 1] int32, cumulative query lengths
    seq_lens     [num_seqs] int32, KV length of each sequence *including* the
                 new tokens of this forward (already written to the cache)
    cos_sin_cache [max_position, head_dim]: cos in the first head_dim/2 columns,
                 sin in the last head_dim/2 (rotate-half / NeoX style, as HF Llama)
    k_scale, v_scale [num_kv_heads] fp32, one layer's scales of an FP8 cache (float8_e4m3fn):
                 the cache holds x / scale rounded to E4M3 and clamped to +-448
                 (``quantize_kv_fp8``), a read gives code * scale; None for any other cache dtype
"""

from __future__ import annotations

import torch

from tandem.kernels.fp8_weight import Fp8Rows, Fp8Weight, dequantize, quantize_rows
from tandem.kernels.lora_rows import split_product

KV_FP8_DTYPE = torch.float8_e4m3fn  # the FP8 KV cache's element type (E4M3, no infinities)
KV_FP8_MAX = 448.0  # its largest finite value


def quantize_kv_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] -> E4M3 codes of x / scale (scale [H], fp32 IEEE division), clamped to +-448
    (past the range a value saturates), rounded to nearest, ties to even."""
    return (x.float() / scale[:, None]).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE)


def dequantize_kv_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes [..., H, D] -> fp32 code * scale (scale [H])."""
    return codes.float() * scale[:, None]


def fp8_query(q: torch.Tensor) -> torch.Tensor:
    """q [..., H, D] as decode attention's FP8_QK form scores it: each head's E4M3 codes under its
    own scale (``quantize_rows``' math: its largest |q| / 448, 1 for a head of zeros), times that
    scale again, in fp32."""
    codes, scale = quantize_rows(q)
    return codes.float() * scale[..., None]


def _is_fp8(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    if cache.dtype != KV_FP8_DTYPE:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 KV cache needs its k_scale and v_scale")
    return True


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, lora=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (or x); return (h / rms(h) * weight, h). Math in fp32. ``lora``
    (kernels.lora_rows.LoraRows): x gets each adapter row's LoRA first (lora_rows_add)."""
    if lora is not None:
        x = lora_rows_add(x, lora)
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype), h


def _fp32(weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """A weight in fp32: an ``Fp8Weight`` dequantized (data * scale[:, None])."""
    return dequantize(weight) if isinstance(weight, Fp8Weight) else weight.float()


def gemv(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] or [K]; weight: [N, K] (or its FP8 form) -> x @ weight.T (+ bias). Math in fp32."""
    y = x.float() @ _fp32(weight).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x: [1, K] or [K]; weight: [2I, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T). Math in fp32."""
    gate, up = (x.float() @ _fp32(weight).T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def skinny_linear_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, lora=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K]; weight: [N, K]; residual [M, N] -> fused_add_rms_norm(x @ weight.T, residual, ...):
    the product in fp32, rounded to x's dtype (as gemv), then added and normed. ``lora``: weight's
    rows past N are every slot's A; the product's columns past N are the rows' shrinks."""
    out = gemv(x, weight)
    if lora is not None:
        num_out = residual.shape[1]
        out, lora = split_product(out, lora, num_out)
    return fused_add_rms_norm(out, residual, norm_weight, eps, lora)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32), x[m] ≈ q[m] * scale[m]: per-row
    (per-token) dynamic quantization, scale = amax(|x[m]|) / 448 (1 for a zero row), q = x / scale
    rounded to nearest even (kernels.fp8_weight.quantize_rows, kept [M, 1] for torch._scaled_mm)."""
    q, scale = quantize_rows(x)
    return q, scale[:, None]


def silu_mul(x: torch.Tensor, lora=None) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] (gate | up) -> silu(gate) * up: [num_tokens, inter]. ``lora``: the
    gate's and the up's LoraRows (kernels.lora_rows.gate_up_rows), added to each half first."""
    gate, up = x.chunk(2, dim=-1)
    if lora is not None:
        gate, up = lora_rows_add(gate, lora[0]), lora_rows_add(up, lora[1])
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)


def _rows_fp8(x: torch.Tensor, keep_values: bool) -> Fp8Rows:
    rows = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_rows_fp8(rows)
    return Fp8Rows(codes, scale, x.dtype, rows if keep_values else None)


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, keep_values: bool = False, lora=None) -> tuple[Fp8Rows, torch.Tensor]:
    """fused_add_rms_norm with its normed output (rounded to x.dtype) quantized per token:
    (quantize_rows_fp8 of it as Fp8Rows [T, hidden], its values kept if ``keep_values``, h)."""
    normed, h = fused_add_rms_norm(x, residual, weight, eps, lora)
    return _rows_fp8(normed, keep_values), h


def silu_mul_fp8(x: torch.Tensor, keep_values: bool = False, lora=None) -> Fp8Rows:
    """silu_mul's output (rounded to x.dtype) quantized per token: Fp8Rows [T, inter] (its
    values kept if ``keep_values``)."""
    return _rows_fp8(silu_mul(x, lora), keep_values)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D/2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """ops.rotary_kv_write in torch."""
    fp8 = _is_fp8(k_cache, k_scale, v_scale)
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q_rot, k_rot = _rotate(q, cos, sin), _rotate(k, cos, sin)
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    if fp8:
        k_cache[blocks, offsets] = quantize_kv_fp8(k_rot[valid], k_scale)
        v_cache[blocks, offsets] = quantize_kv_fp8(v[valid], v_scale)
    else:
        k_cache[blocks, offsets] = k_rot[valid].to(k_cache.dtype)
        v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)
    return q_rot, k_rot


def _gather_seq_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    # -> [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window=None,
                      chunk_kv=None, k_scale=None, v_scale=None):
    """ops.prefill_attention in torch."""
    fp8 = _is_fp8(k_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = _gather_seq_kv(k_cache, block_tables[b], seq_len)
        v = _gather_seq_kv(v_cache, block_tables[b], seq_len)
        k, v = (dequantize_kv_fp8(k, k_scale), dequantize_kv_fp8(v, v_scale)) if fp8 else (k.float(), v.float())
        if chunk_kv is not None:
            k[seq_len - (e - s):] = chunk_kv[0][s:e].float()
            v[seq_len - (e - s):] = chunk_kv[1][s:e].float()
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qb = q[s:e].float()  # [Q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def decode_attention_new_token(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                               seq_lens, scale, sliding_window=None, k_scale=None, v_scale=None):
    """ops.decode_attention_new_token in torch: rotary_kv_write, then decode_attention."""
    q_rot, _ = rotary_kv_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return decode_attention(q_rot, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, k_scale, v_scale)


def decode_attention_variants(max_rows, max_width, q_dtype, k_cache, sliding_window=None):
    """ops.decode_attention_variants of the torch reference: one form for every shape."""
    return {(): (max_rows, max_width)}


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, k_scale=None,
                     v_scale=None):
    """ops.decode_attention in torch: prefill_attention with one query per sequence."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
        k_scale=k_scale, v_scale=v_scale,
    )


def gather_blocks(kv_pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """kv_pool[:, :, block_ids] as a contiguous staging tensor [L, 2, n, bs, H, D] (into ``out``)."""
    if out is None:
        return kv_pool[:, :, block_ids.long()].contiguous()
    out.copy_(kv_pool[:, :, block_ids.long()])
    return out


def scatter_blocks(kv_pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """kv_pool[:, :, block_ids] = staging (in place)."""
    kv_pool[:, :, block_ids.long()] = staging.to(kv_pool.dtype)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    prompt: torch.Tensor, params: torch.Tensor) -> None:
    """In place: penalize row ``rows[i]`` of ``logits`` [B, V] fp32 by what slot ``slots[i]`` holds,
    ``counts`` [C, V] fp32 (each token's occurrences in the output) and ``prompt`` [C, V] bool (the
    prompt's tokens), with ``params[i]`` = (repetition, frequency, presence) ([R, 3] fp32)::

        x = x * repetition if x < 0 else x / repetition   where the token is in prompt or output
        x = x - (frequency * count + presence * (count > 0))

    (HF's repetition rule, computed as HF computes it; OpenAI's presence and frequency.)
    ``rows`` distinct, ``rows`` and ``slots`` [R] int64."""
    x = logits[rows]
    c = counts[slots]
    seen = prompt[slots] | (c > 0)
    repetition, frequency, presence = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition), x)
    logits[rows] = x - (frequency * c + presence * (c > 0))


def _lora_segments(token_order: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor):
    """(slot, rows [n] int64) of each segment that has rows and a slot (slot -1: skipped)."""
    starts = seg_starts.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        if slot >= 0 and starts[i + 1] > starts[i]:
            yield slot, token_order[starts[i]:starts[i + 1]].long()


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor) -> torch.Tensor:
    """LoRA's first product (one half of ``ops.lora_add``): out[t] = x[t] @ a_stacked[slot(t)].T for
    every row t of a segment; x [T, K], a_stacked [L, R, K] -> [T, R] fp32, zero in rows of no segment."""
    out = torch.zeros(x.shape[0], a_stacked.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _lora_segments(token_order, seg_starts, seg_slots):
        out[rows] = x[rows].float() @ a_stacked[slot].float().T
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, b_stacked: torch.Tensor, token_order: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, scales: torch.Tensor) -> None:
    """LoRA's second product, in place: y[t] += (shrunk[t] @ b_stacked[slot(t)].T) * scales[slot(t)]
    for every row t of a segment, in fp32, rounded to y's dtype once; y [T, N] (or a column slice),
    shrunk [T, R] fp32, b_stacked [L, N, R], scales [L] fp32."""
    for slot, rows in _lora_segments(token_order, seg_starts, seg_slots):
        delta = (shrunk[rows].float() @ b_stacked[slot].float().T) * scales[slot].float()
        y[rows] = (y[rows].float() + delta).to(y.dtype)


def lora_add(y: torch.Tensor, x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor, offsets: list[int],
             scales: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """ops.lora_add in torch (in place on ``y``)."""
    shrunk = lora_shrink(x, a_stacked, token_order, seg_starts, seg_slots)
    _expand_parts(y, shrunk, b_stacked, offsets, scales, token_order, seg_starts, seg_slots)


def lora_expand_slots(y: torch.Tensor, shrunk: torch.Tensor, b_stacked: torch.Tensor, offsets: list[int],
                      scales: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
                      seg_slots: torch.Tensor) -> None:
    """ops.lora_expand_slots in torch (in place on ``y``): lora_add's expand, a row of slot s taking
    its shrink from columns s * P * R .. (s + 1) * P * R of ``shrunk`` [T, L * P * R]."""
    width = len(offsets) * b_stacked.shape[2]
    rows_shrunk = torch.zeros(shrunk.shape[0], width, dtype=torch.float32, device=shrunk.device)
    for slot, rows in _lora_segments(token_order, seg_starts, seg_slots):
        rows_shrunk[rows] = shrunk[rows, slot * width:(slot + 1) * width].float()
    _expand_parts(y, rows_shrunk, b_stacked, offsets, scales, token_order, seg_starts, seg_slots)


def _expand_parts(y, shrunk, b_stacked, offsets, scales, token_order, seg_starts, seg_slots) -> None:
    rank = b_stacked.shape[2]
    bounds = list(offsets) + [y.shape[1]]
    for part in range(len(offsets)):
        lo, hi = bounds[part], bounds[part + 1]
        lora_expand(y[:, lo:hi], shrunk[:, part * rank:(part + 1) * rank], b_stacked[:, lo:hi],
                    token_order, seg_starts, seg_slots, scales[part])


def lora_partials(x: torch.Tensor, a_stacked: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
                  seg_slots: torch.Tensor) -> torch.Tensor:
    """ops.lora_partials in torch: lora_shrink as one split, [1, T, R]."""
    return lora_shrink(x, a_stacked, token_order, seg_starts, seg_slots)[None]


def lora_rows_add(y: torch.Tensor, rows) -> torch.Tensor:
    """y + each adapter row's LoRA (kernels.lora_rows.LoraRows): row t of slot s >= 0 gets
    (sum over splits of partials[:, t, s * slot_stride:][:R]) @ b[s].T * scales[s], in fp32, rounded
    to y's dtype once: lora_expand's math. -> a new tensor."""
    out = y.clone()
    slots = rows.row_slots.tolist()
    shrunk = rows.partials.float().sum(0)
    rank = rows.b.shape[2]
    for slot in sorted({s for s in slots if s >= 0}):
        index = torch.tensor([t for t, s in enumerate(slots) if s == slot], device=y.device)
        first = slot * rows.slot_stride
        delta = (shrunk[index, first:first + rank] @ rows.b[slot].float().T) * rows.scales[slot].float()
        out[index] = (y[index].float() + delta).to(y.dtype)
    return out
