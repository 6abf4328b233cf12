"""Op dispatch: Triton kernels for CUDA tensors, torch references otherwise.

The engine calls only these functions. ``TANDEM_KERNELS=reference`` forces the
references everywhere (useful to bisect a numerical difference on the GPU).

A projection's weight is a tensor or an ``Fp8Weight`` (kernels.fp8_weight); the matmul
ops take either: FP8 weights go through the same GEMV and skinny GEMM (dequantized in
registers), and past them through FP8 tensor cores (``kernels.fp8_matmul``), or on the
CPU dequantized then multiplied.
"""

from __future__ import annotations

import importlib
from functools import cache

import torch

from tandem.kernels import fp8_matmul, reference, switches
from tandem.kernels.fp8_matmul import fp8_skinny_max_rows, fp8_tensor_skinny_max_rows
from tandem.kernels.fp8_weight import Fp8Rows, Fp8Weight, dequantize
from tandem.kernels.lora_rows import split_product

# op name -> module in this package holding its Triton implementation
_TRITON_MODULES = {
    "fused_add_rms_norm": "tandem.kernels.rms_norm",
    "fused_add_rms_norm_fp8": "tandem.kernels.rms_norm",
    "silu_mul": "tandem.kernels.activation",
    "silu_mul_fp8": "tandem.kernels.activation",
    "gemv": "tandem.kernels.gemv",
    "gemv_silu_mul": "tandem.kernels.gemv",
    "skinny_linear": "tandem.kernels.skinny_gemm",
    "skinny_silu_mul": "tandem.kernels.skinny_gemm",
    "skinny_linear_add_rms_norm": "tandem.kernels.skinny_gemm",
    "rotary_kv_write": "tandem.kernels.rotary",
    "prefill_attention": "tandem.kernels.prefill_attention",
    "decode_attention": "tandem.kernels.decode_attention",
    "decode_attention_new_token": "tandem.kernels.decode_attention",
    "decode_attention_variants": "tandem.kernels.decode_attention",
    "gather_blocks": "tandem.kernels.block_copy",
    "scatter_blocks": "tandem.kernels.block_copy",
    "apply_penalties": "tandem.kernels.penalties",
    "quantize_rows_fp8": "tandem.kernels.fp8_quant",
    "lora_add": "tandem.kernels.lora",
    "lora_partials": "tandem.kernels.lora",
    "lora_expand_slots": "tandem.kernels.lora",
}


@cache
def _triton_impl(name: str):
    if switches.current().kernels == "reference":
        return None
    try:
        return getattr(importlib.import_module(_TRITON_MODULES[name]), name)
    except (ImportError, AttributeError):
        return None


def _pick(name: str, tensor: torch.Tensor):
    if tensor.is_cuda:
        impl = _triton_impl(name)
        if impl is not None:
            return impl
    return getattr(reference, name)


def fused_add_rms_norm(x, residual, weight, eps, quantize_for=None, keep_values=False, lora=None):
    """-> (x + residual normed, x + residual). ``quantize_for``: the weight the normed rows go into;
    where that projection would quantize them per token anyway (``quantizes_input``), they come
    as ``Fp8Rows``, quantized by the norm's own kernel (``keep_values``: with the rows in the
    model's dtype too, for a kernel that reads those: ``fp8_weight.in_model_dtype``). ``lora``
    (``lora_rows.LoraRows``): x's adapter rows get their LoRA first, in the same kernel."""
    if quantize_for is not None and quantizes_input(x, quantize_for):
        return _pick("fused_add_rms_norm_fp8", x)(x, residual, weight, eps, keep_values, lora=lora)
    return _pick("fused_add_rms_norm", x)(x, residual, weight, eps, lora=lora)


def silu_mul(x, quantize_for=None, keep_values=False, lora=None):
    """silu(gate) * up of x = [gate | up]; ``quantize_for``, ``keep_values`` as fused_add_rms_norm's.
    ``lora``: the gate's and the up's ``lora_rows.LoraRows`` (``lora_rows.gate_up_rows``): each adapter
    row's LoRA added to both halves first, in the same kernel."""
    if quantize_for is not None and quantizes_input(x[..., : x.shape[-1] // 2], quantize_for):
        return _pick("silu_mul_fp8", x)(x, keep_values, lora=lora)
    return _pick("silu_mul", x)(x, lora=lora)


# The kernel before an FP8 projection (an RMSNorm, SiLU·mul) writes its output quantized per token
# (Fp8Rows) instead of leaving it to the projection's own quantization pass: one kernel and one
# round trip of the activations less per projection (three of a layer's four). TANDEM_FUSED_FP8_QUANT=0
# turns it off (tandem.kernels.switches). The results are the same bits either way.
def quantizes_input(x, weight) -> bool:
    """Whether every FP8 route that takes rows like ``x`` into ``weight`` (linear, gate_up_silu_mul,
    linear_add_rms_norm) quantizes them per token first: then they may come as ``Fp8Rows``. Past
    one row and past fp8_skinny_max_rows(), ``_triton_matmul`` sends an FP8 weight to the
    tensor-core skinny GEMM or to ``_matmul``, whatever its row limit; both quantize where
    ``fp8_matmul.takes`` (the skinny one only takes those). Called a few times a layer: no more."""
    return (isinstance(weight, Fp8Weight) and switches.current().fused_fp8_quant
            and x.shape[0] > max(1, fp8_skinny_max_rows()) and fp8_matmul.takes(x, weight))


def _fp8_rows(x):
    """(E4M3 codes, scales [M, 1]) of x: as they came (Fp8Rows), else quantized now."""
    return (x.codes, x.scale) if isinstance(x, Fp8Rows) else quantize_rows_fp8(x)


def _needs_model_dtype(kind: str | None, x) -> None:
    if isinstance(x, Fp8Rows):  # quantizes_input said every route quantizes: a broken promise
        raise ValueError(f"rows already quantized reached the {kind or 'unquantized'} route of an FP8 weight")


# Decode batches multiply through tandem.kernels.skinny_gemm up to these many tokens (0 turns it
# off). Engine A/B against cuBLAS on one H200 (torch 2.11, triton 3.6), 2026-11-30, at 6fbcc11
# (scripts/decode_ab.py --batches 1,8,16,32,64 --variants rule,cublas,skinny32,skinny64, removed
# since) and ea8f9db (python3 -m tandem.bench.tune_skinny_gemm --quick; decode_ab at 128 rows;
# docs/kernels.md): at 8 tokens the step is 5.4% faster on llama2-7b (4.61 -> 4.36 ms), 3.2% on
# llama3-8b, 3.7% on llama3.2-1b; at 32 tokens 1-4%; at 64 only the long-K projections (K >= 2N:
# down) beat cuBLAS (llama2-7b 30.9 -> 27.4 us per layer; with every projection the 7B step lost
# 0.22 ms), and at 128 every projection lost.
SKINNY_GEMM_MAX_ROWS = 32
SKINNY_GEMM_LONG_K_MAX_ROWS = 64
SKINNY_GEMM_ROWS_LIMIT = 128  # kernels.skinny_gemm.MAX_M: the most rows its kernels take
# gate/up with SiLU·mul fused through the skinny GEMM up to this many rows (its own rule: the
# fused form also saves the SiLU·mul kernel that cuBLAS needs after it; at 33-64 rows with its own
# tile, tandem.kernels.skinny_tiles.tile_config: llama2-7b b64 6.51 -> 6.46 ms per step, engine A/B
# on one H200, 2026-11-30, at ecd6a75: scripts/decode_ab.py --models llama2-7b --batches 64
# --rounds 2 --variants rule,gate_up64_w,gate_up64_n, removed since; docs/kernels.md).
SKINNY_SILU_MUL_MAX_ROWS = 64


def linear(x, weight, bias=None):
    """x: [T, K] -> [T, N]. On CUDA one token goes through the Triton GEMV, a small decode batch
    through the skinny GEMM (_triton_matmul); otherwise cuBLAS / torch."""
    kind = _triton_matmul(x, weight, bias)
    if kind == "skinny_fp8":
        x_q, x_scale = _fp8_rows(x)
        return _pick("skinny_linear", x)(x_q, weight, bias, x_scale=x_scale, out_dtype=x.dtype)
    if kind is not None:
        _needs_model_dtype(kind, x)
    if kind == "gemv":
        return _pick("gemv", x)(x, weight, bias)
    if kind == "skinny":
        return _pick("skinny_linear", x)(x, weight, bias)
    return _matmul(x, weight, bias)


def gate_up_silu_mul(x, weight, quantize_for=None):
    """x: [T, K], weight [2I, K] = [gate; up] -> silu(gate) * up: [T, I], one kernel on CUDA (as
    linear). ``quantize_for``: the down projection's weight (fused_add_rms_norm's); on cuBLAS's
    route the SiLU·mul after it then writes Fp8Rows."""
    kind = _triton_matmul(x, weight, None, SKINNY_SILU_MUL_MAX_ROWS)
    if kind == "skinny_fp8":
        x_q, x_scale = _fp8_rows(x)
        return _pick("skinny_silu_mul", x)(x_q, weight, x_scale=x_scale, out_dtype=x.dtype)
    if kind is not None:
        _needs_model_dtype(kind, x)
    if kind == "gemv":
        return _pick("gemv_silu_mul", x)(x, weight)
    if kind == "skinny":
        return _pick("skinny_silu_mul", x)(x, weight)
    return silu_mul(_matmul(x, weight, None), quantize_for)


def _matmul(x, weight, bias):
    """cuBLAS / torch: F.linear; an FP8 weight on FP8 tensor cores with x quantized per token
    (fp8_matmul.scaled_mm, where it runs: bf16 x on sm89+), else dequantized to x's dtype."""
    if isinstance(weight, Fp8Weight) and fp8_matmul.takes(x, weight):
        x_q, x_scale = _fp8_rows(x)
        return fp8_matmul.scaled_mm(x_q, x_scale, weight, bias, x.dtype)
    _needs_model_dtype(None, x)
    if not isinstance(weight, Fp8Weight):
        return torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)


def quantize_rows_fp8(x):
    """x [M, K] -> (E4M3 [M, K], fp32 scales [M, 1]): per-token dynamic quantization (reference.quantize_rows_fp8)."""
    return _pick("quantize_rows_fp8", x)(x)


def _triton_matmul(x, weight, bias, max_rows: int | None = None) -> str | None:
    """"gemv" (one row) or "skinny" (2 .. SKINNY_GEMM_MAX_ROWS rows, or .. SKINNY_GEMM_LONG_K_MAX_ROWS
    for a weight with K >= 2N, or .. max_rows where given) on CUDA, in the layouts those kernels
    read (TANDEM_GEMV=0 turns both off); for an FP8 weight "skinny" up to fp8_skinny_max_rows(), then
    "skinny_fp8" (x quantized per token, the skinny GEMM on FP8 tensor cores) up to
    fp8_tensor_skinny_max_rows(); None: F.linear, or for an FP8 weight torch's scaled matmul."""
    if not _triton_layout(x, weight, bias):
        return None
    if x.shape[0] == 1:
        return "gemv" if _triton_impl("gemv") is not None else None
    rows, (num_out, K) = x.shape[0], weight.shape
    if isinstance(weight, Fp8Weight) and rows > fp8_skinny_max_rows():
        if (rows <= min(fp8_tensor_skinny_max_rows(), SKINNY_GEMM_ROWS_LIMIT) and K % 32 == 0
                and _triton_impl("skinny_linear") is not None and _triton_impl("quantize_rows_fp8") is not None
                and fp8_matmul.takes(x, weight)):
            return "skinny_fp8"
        return None  # FP8 tensor cores (_matmul)
    if max_rows is None:
        max_rows = max(SKINNY_GEMM_LONG_K_MAX_ROWS, SKINNY_GEMM_MAX_ROWS) if K >= 2 * num_out else SKINNY_GEMM_MAX_ROWS
    max_rows = min(max_rows, SKINNY_GEMM_ROWS_LIMIT)
    if rows <= max_rows and _triton_impl("skinny_linear") is not None:
        return "skinny"
    return None


def _triton_layout(x, weight, bias) -> bool:
    """x [T > 0, K > 0] and weight [N, K] with contiguous rows, one dtype (or an Fp8Weight with
    contiguous rows and [N] contiguous fp32 scales), a matching contiguous bias or none, on CUDA,
    TANDEM_GEMV not 0: what the GEMV and the skinny GEMM take."""
    if isinstance(weight, Fp8Weight):
        scale = weight.scale
        if not (scale.dim() == 1 and scale.shape[0] == weight.shape[0] and scale.stride(0) == 1
                and scale.dtype == torch.float32):
            return False
        weight = weight.data
    elif x.dtype != weight.dtype:
        return False
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] and x.shape[1] > 0 and x.stride(1) == 1
            and weight.dim() == 2 and weight.stride(1) == 1
            and (bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.dtype == x.dtype
                                  and bias.shape[0] == weight.shape[0]))
            and switches.current().gemv)


# A decode batch's o and down projections end in the skinny GEMM's finishing kernel, which also
# adds the residual and applies the next RMSNorm (one kernel less per projection), from 2 up to
# this many tokens (0: off). Engine A/B on one H200 (torch 2.11, triton 3.6), 2026-11-30, at
# a82129f and 3197fbc (scripts/decode_ab.py --batches 8,16,32,64 --variants unfused,rule, removed
# since; docs/kernels.md), unfused -> fused: llama2-7b b64 6.735 -> 6.678 and 6.558 -> 6.467 ms,
# llama3-8b b64 5.546 -> 5.457 and 5.418 -> 5.316, b16/b32 -0.03/-0.05, llama2-7b b8 -0.03;
# llama3-8b b8 +0.04 to +0.08 (not understood).
# At 64 rows this moves the o projection from cuBLAS to the skinny GEMM (up to 32 only: 7B b64 6.734).
FUSED_NORM_MAX_ROWS = 64


def linear_add_rms_norm(x, weight, residual, norm_weight, eps, quantize_for=None, lora=None, keep_values=False):
    """fused_add_rms_norm(linear(x, weight), residual, norm_weight, eps, quantize_for, keep_values) ->
    (normed, new residual). On CUDA, for 2 .. FUSED_NORM_MAX_ROWS tokens, one skinny GEMM whose
    finishing kernel adds and norms (and quantizes, for ``quantize_for``, unless ``keep_values``: it
    writes the codes alone). ``lora`` (``lora_rows.LoraRows``, its partials unused): ``weight``'s rows
    past the residual's columns are every slot's A (engine.lora_weights), and the adapter rows' LoRA
    is added before the add."""
    rows = x.shape[0] if x.dim() == 2 else 0
    num_out = weight.shape[0] - (0 if lora is None else lora.b.shape[0] * lora.b.shape[2])
    fused = _triton_impl("skinny_linear_add_rms_norm")
    limit = min(FUSED_NORM_MAX_ROWS, SKINNY_GEMM_ROWS_LIMIT)
    if (fused is not None and 2 <= rows <= limit
            and _triton_layout(x, weight, None) and residual is not None
            and residual.shape == (rows, num_out) and residual.dtype == x.dtype):
        kind = _triton_matmul(x, weight, None, limit) if isinstance(weight, Fp8Weight) else "skinny"
        # the normed rows have the residual's shape: quantized by the finishing kernel where wanted
        fp8_out = quantize_for is not None and not keep_values and quantizes_input(residual, quantize_for)
        if kind == "skinny":
            _needs_model_dtype(kind, x)
            return fused(x, weight, residual, norm_weight, eps, fp8_out=fp8_out, lora=lora)
        if kind == "skinny_fp8":
            x_q, x_scale = _fp8_rows(x)
            return fused(x_q, weight, residual, norm_weight, eps, x_scale=x_scale, fp8_out=fp8_out, lora=lora)
    out = linear(x, weight)
    if lora is not None:  # the product's last columns are every slot's shrink
        out, lora = split_product(out, lora, num_out)
    return fused_add_rms_norm(out, residual, norm_weight, eps, quantize_for, keep_values=keep_values, lora=lora)


# The attention ops take an FP8 cache's per-head scales of the layer (k_scale, v_scale: [num_kv_heads]
# fp32; None for a cache in the model's dtype): reference.quantize_kv_fp8 / dequantize_kv_fp8. They
# are passed on only when given, so a cache in the model's dtype is called as it always was.
def _scales(k_scale, v_scale) -> tuple:
    return () if k_scale is None and v_scale is None else (k_scale, v_scale)


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions, write rotated k and v into the paged cache.

    q [T, Hq, D], k and v [T, Hkv, D], positions [T] int64, cos_sin_cache [max_position, D]
    fp32, slot_mapping [T] int64. Returns (q_rot, k_rot). Tokens whose slot is -1 are rotated
    but not written. An FP8 cache gets the E4M3 codes of k_rot / k_scale and v / v_scale
    (``reference.quantize_kv_fp8``).
    """
    return _pick("rotary_kv_write", q)(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                       *_scales(k_scale, v_scale))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal variable-length attention over each sequence's cached blocks.

    Sequence b's queries are its last q_len_b positions: query i sits at
    position seq_len_b - q_len_b + i and sees keys at positions p with
    p <= pos and (sliding_window is None or pos - p < sliding_window).
    GQA: query head h reads kv head h // (num_q_heads // num_kv_heads).
    ``chunk_kv``: (k, v) of the chunk's own tokens [num_tokens, num_kv_heads, head_dim], k
    rotated (what ``rotary_kv_write`` wrote to the cache): keys at a sequence's last q_len
    positions are read from them instead of through the block table. An FP8 cache (float8_e4m3fn)
    is read as code * scale with its [num_kv_heads] fp32 ``k_scale`` and ``v_scale``.
    """
    return _pick("prefill_attention", q)(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, chunk_kv,
        *_scales(k_scale, v_scale),
    )


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (q: [num_seqs, num_q_heads, head_dim]) at position seq_len - 1:
    ``prefill_attention`` with one-token chunks."""
    return _pick("decode_attention", q)(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                        *_scales(k_scale, v_scale))


def decode_attention_variants(max_rows: int, max_width: int, q_dtype: torch.dtype, k_cache: torch.Tensor,
                              sliding_window: int | None = None) -> dict[tuple, tuple[int, int]]:
    """Each compiled form of ``decode_attention`` over 1..``max_rows`` rows and block tables
    1..``max_width`` entries wide -> one (rows, width) that launches it (``engine.warmup`` runs a
    step of each before traffic); the torch reference has one form."""
    return _pick("decode_attention_variants", k_cache)(max_rows, max_width, q_dtype, k_cache, sliding_window)


def decode_attention_new_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                               cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``rotary_kv_write`` then ``decode_attention``: q, k, v of each sequence's new token
    unrotated; its rotated k and v land in the cache (slot -1: not written; an FP8 cache gets
    their codes)."""
    return _pick("decode_attention_new_token", q)(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                  block_tables, seq_lens, scale, sliding_window,
                                                  *_scales(k_scale, v_scale))


# Engine A/B on one H200 (torch 2.11, triton 3.6), 2026-11-29, at f1fd6a8 and e85a817
# (TANDEM_FUSED_ROTARY=0, then 1: tandem bench engine --batches 1,64 --anchors ''; docs/kernels.md):
# the fused form is 1-3% faster per step at batch 1 (llama3.2-1b, llama2-7b, llama3-8b) and
# 1.5-3.6% slower at batch 64 on llama2-7b.
FUSED_ROTARY_MAX_BATCH = 8


def fused_decode_rotary(num_seqs: int) -> bool:
    """Whether a decode step of ``num_seqs`` sequences runs rotary and the KV write inside the
    attention kernel: TANDEM_FUSED_ROTARY=1 always, =0 never, unset (auto) for small batches."""
    mode = switches.current().fused_rotary
    if mode == "auto":
        return num_seqs <= FUSED_ROTARY_MAX_BATCH
    return mode == "1"


def gather_blocks(kv_pool, block_ids, out=None):
    """kv_pool [L, 2, N, bs, H, D][:, :, block_ids] -> a staging tensor [L, 2, n, bs, H, D]; into
    ``out`` when given (any such tensor whose blocks are contiguous: a block-major buffer's
    ``movedim(0, 2)`` view, say), else a new contiguous one."""
    return _pick("gather_blocks", kv_pool)(kv_pool, block_ids, out)


def scatter_blocks(kv_pool, block_ids, staging):
    """kv_pool[:, :, block_ids] = staging ([L, 2, n, bs, H, D], blocks contiguous), in place."""
    return _pick("scatter_blocks", kv_pool)(kv_pool, block_ids, staging)


def apply_penalties(logits, rows, slots, counts, prompt, params):
    """In place on ``logits``: the repetition, frequency and presence penalties (reference.apply_penalties)."""
    return _pick("apply_penalties", logits)(logits, rows, slots, counts, prompt, params)


# LoRA (engine.lora_batch): the rows of a step that carry an adapter, grouped into segments of one
# device slot each. Segment i holds the rows token_order[seg_starts[i]:seg_starts[i + 1]], all of
# slot seg_slots[i]; a segment of slot -1 is skipped; rows in no segment (the base model's) are left
# alone. token_order [A] int64 (each row at most once), seg_starts [S + 1] int32 (non-decreasing,
# seg_starts[0] = 0, seg_starts[S] <= A), seg_slots [S] int32.
def lora_add(y, x, a_stacked, b_stacked, offsets: list[int], scales, token_order, seg_starts, seg_slots) -> None:
    """A whole projection's LoRA, added in place: for each part p of a fused projection (q, k, v;
    gate, up; or one), columns offsets[p] .. offsets[p + 1] (the last: .. N) of y[t] get
    (x[t] @ A_p^T @ B_p^T) * scales[p, slot(t)], where A_p is rows p * R .. (p + 1) * R of
    a_stacked[slot(t)] and B_p those columns' rows of b_stacked[slot(t)]: the shrink then each
    part's expand (``reference.lora_shrink``, ``reference.lora_expand``), with the same rounding.

    y [T, N] (columns contiguous); x [T, K]; a_stacked [L, P * R, K]; b_stacked [L, N, R];
    offsets P ints (offsets[0] = 0, ascending; P <= 3); scales [P, L] fp32.
    """
    return _pick("lora_add", y)(y, x, a_stacked, b_stacked, offsets, scales, token_order, seg_starts, seg_slots)


def lora_expand_slots(y, shrunk, b_stacked, offsets, scales, token_order, seg_starts, seg_slots):
    """lora_add's expand alone, from every slot's shrink [T, L * P * R] (a fused weight's extra columns)."""
    return _pick("lora_expand_slots", y)(y, shrunk, b_stacked, offsets, scales, token_order, seg_starts, seg_slots)


def lora_partials(x, a_stacked, token_order, seg_starts, seg_slots):
    """lora_add's shrink alone, [S, T, R] fp32 split-K partial sums (rows of no segment unwritten):
    for the kernel after a projection to expand (``lora_rows.LoraRows``)."""
    return _pick("lora_partials", x)(x, a_stacked, token_order, seg_starts, seg_slots)
