"""Skinny matrix products for decode batches (2 to 128 tokens), Triton.

    linear:        y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n])
    silu-mul:      W = [gate; up] (2I rows): y[m, i] = silu(g[m, i]) * u[m, i],  g = x W[:I].T,  u = x W[I:].T

At a few dozen tokens a projection is still a weight read: W is read once and
used M times, x is a few hundred KB that stays in L2. The product is "swapped":
the weight rows are the MMA's long side (64 rows fill one sm90 wgmma tile) and the
tokens its short side (padded to >= 16), so each program streams BLOCK_N whole
rows of W in BLOCK_K-wide tiles, contiguous along K, through a software-pipelined
loop (num_stages tiles in flight), and keeps acc[BLOCK_N, BLOCK_M] = W x^T in fp32.
Where the weight has too few row blocks to fill the SMs, K is split (grid axis 1):
each split writes fp32 partial sums and a second small kernel adds them up and
finishes (bias, SiLU·mul, cast). The silu-mul form computes the gate and up rows
of the same outputs in one program, as kernels.gemv does.

    linear + add + RMSNorm:  y = x W.T (rounded to x's dtype),  h = y + residual,
                             out = h / sqrt(mean(h^2) + eps) * norm_weight   -> (out, h)

The o and down projections of a decoder layer are followed by the residual add and
the next RMSNorm: there the finishing kernel (always run, one program per token
row) does both, so the norm costs no kernel of its own.

FP8 weights (``kernels.fp8_weight.Fp8Weight``: E4M3 rows, one fp32 scale per row) stream
half the bytes through the same loop: each weight tile is widened in registers to x's
dtype (exact: every E4M3 value is a bf16, fp16 and fp32 value) for the same MMA, and
each row's fp32 sum is multiplied by its scale before anything else sees it (the
split-K partials too, so the finishing kernel is the same).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels.device_props import num_sms
from tandem.kernels.dot import dot, upcast_bf16_dot
from tandem.kernels.fp8_kv import soft_round
from tandem.kernels.fp8_quant import row_scale, to_codes
from tandem.kernels.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Rows, Fp8Weight
from tandem.kernels.gemv import _split_weight
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options
from tandem.kernels.lora_rows import LoraRows
from tandem.kernels.rms_norm import lora_row_add, rms_norm_row, row_num_warps
from tandem.kernels.skinny_tiles import tile_config

MAX_M = 128  # the x tile and the accumulators grow with M: beyond this, cuBLAS's own tiles


@triton.jit(do_not_specialize=["M"])  # the rows vary per step; BLOCK_M (from M) is what compiles apart
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, num_out, K, stride_xm, stride_wn, stride_ym, stride_ys,
    tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, WORKSPACE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_PDL: tl.constexpr = False,
    s_ptr=None, W_SCALED: tl.constexpr = False, xs_ptr=None, X_SCALED: tl.constexpr = False,
):
    """acc[n, m] = sum_k W[n, k] x[m, k] over this program's BLOCK_N rows and its split's K tiles
    [s * tiles_per_split, (s + 1) * tiles_per_split) * BLOCK_K (clipped to K), fp32;
    SILU_MUL also acc_up[n, m] = sum_k W[num_out + n, k] x[m, k] (the up rows).
    Not WORKSPACE (one split): y[m, n] = acc[n, m] (+ b[n]) or silu(acc[n, m]) * acc_up[n, m];
    WORKSPACE: y is the fp32 workspace [splits, M, stride_ym]: ws[s, m, n] = acc[n, m] and
    ws[s, m, num_out + n] = acc_up[n, m], finished by _split_sum_kernel. No split is empty.
    W_SCALED (FP8 weights): W[n, k] = w[n, k] * s[n]; the E4M3 tiles are widened to x's dtype for
    the dot and acc (acc_up) multiplied by s[n] (s[num_out + n]) before it is stored or finished.
    X_SCALED (with W_SCALED: FP8 activations): x holds E4M3 codes with x[m, k] ≈ x[m, k] * xs[m]; the
    dot runs on the E4M3 codes of both (FP8 tensor cores, fp32 accumulation) and acc is multiplied
    by xs[m] too.

    As in kernels.gemv, the first weight tile is loaded before waiting for the previous kernel
    (kernels.pdl); x comes from it. The loop's addresses depend only on k0, so Triton can
    issue the loads of the next num_stages - 1 tiles while this one is multiplied.
    """
    if USE_PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_out
    rows = tl.where(row_mask, rows, 0).to(tl.int64)  # masked rows read row 0, never stored
    tokens = tl.arange(0, BLOCK_M)
    token_mask = tokens < M  # padding tokens read as 0, never stored
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + rows[:, None] * stride_wn + cols[None, :]
    up_ptrs = w_ptr + (rows + num_out)[:, None] * stride_wn + cols[None, :]  # int64 row offsets
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + cols[None, :]
    k_lo = tl.program_id(1) * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + tiles_per_split * BLOCK_K, K)
    kmask = k_lo + cols < K  # only the last tile of K is ragged: splits start on tile boundaries
    if EVEN_K:
        w = tl.load(gate_ptrs + k_lo)
    else:
        w = tl.load(gate_ptrs + k_lo, mask=kmask[None, :], other=0.0)
    u = w
    if SILU_MUL:
        if EVEN_K:
            u = tl.load(up_ptrs + k_lo)
        else:
            u = tl.load(up_ptrs + k_lo, mask=kmask[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()
    x = tl.load(x_ptrs + k_lo, mask=token_mask[:, None] & kmask[None, :], other=0.0)
    if W_SCALED and not X_SCALED:
        w = w.to(x_ptr.dtype.element_ty)
        u = u.to(x_ptr.dtype.element_ty)
    acc = dot(w, tl.trans(x), DOT_PRECISION, DOT_UPCAST)
    acc_up = acc
    if SILU_MUL:
        acc_up = dot(u, tl.trans(x), DOT_PRECISION, DOT_UPCAST)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(gate_ptrs + k0)
            x = tl.load(x_ptrs + k0, mask=token_mask[:, None], other=0.0)
        else:
            in_k = k0 + cols < K
            w = tl.load(gate_ptrs + k0, mask=in_k[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=token_mask[:, None] & in_k[None, :], other=0.0)
        if W_SCALED and not X_SCALED:
            w = w.to(x_ptr.dtype.element_ty)
        acc += dot(w, tl.trans(x), DOT_PRECISION, DOT_UPCAST)
        if SILU_MUL:
            if EVEN_K:
                u = tl.load(up_ptrs + k0)
            else:
                u = tl.load(up_ptrs + k0, mask=in_k[None, :], other=0.0)
            if W_SCALED and not X_SCALED:
                u = u.to(x_ptr.dtype.element_ty)
            acc_up += dot(u, tl.trans(x), DOT_PRECISION, DOT_UPCAST)
    if W_SCALED:  # the rows' scales (masked rows read row 0's, never stored)
        acc *= tl.load(s_ptr + rows)[:, None]
        if SILU_MUL:
            acc_up *= tl.load(s_ptr + rows + num_out)[:, None]
    if X_SCALED:  # the tokens' scales (padding tokens read token 0's, never stored)
        x_scale = tl.load(xs_ptr + tl.where(token_mask, tokens, 0))[None, :]
        acc *= x_scale
        if SILU_MUL:
            acc_up *= x_scale
    out_mask = row_mask[:, None] & token_mask[None, :]
    out_ptrs = y_ptr + tokens[None, :] * stride_ym + rows[:, None]
    if WORKSPACE:
        out_ptrs += tl.program_id(1).to(tl.int64) * stride_ys
        tl.store(out_ptrs, acc, mask=out_mask)
        if SILU_MUL:
            tl.store(out_ptrs + num_out, acc_up, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_sum_kernel(
    ws_ptr, b_ptr, y_ptr, res_ptr, norm_w_ptr, new_res_ptr, ys_ptr, num_out, stride_ws, stride_wm, stride_ym,
    stride_rm, stride_nrm, eps,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    ADD_NORM: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    FP8_OUT: tl.constexpr = False, FP8_LIMIT: tl.constexpr = 448.0, SOFT_ROUND: tl.constexpr = False,
    lb_ptr=None, ls_ptr=None, lslot_ptr=None, stride_lb_slot=0, lora_rank=0, LORA: tl.constexpr = False,
    RANK_PAD: tl.constexpr = 16, SPLITS_PAD: tl.constexpr = 1,
):
    """y[m, n] = sum_s ws[s, m, n] (+ b[n]);  SILU_MUL: y[m, n] = silu(g) * u with
    g = sum_s ws[s, m, n], u = sum_s ws[s, m, num_out + n]; fp32 until the cast.
    ADD_NORM (one program per row, BLOCK >= num_out): with p = y[m] rounded to y's dtype (what
    linear returns), h = p + residual[m] rounded the same way, new_residual[m] = h and
    y[m] = h * rsqrt(sum(h^2) / num_out + eps) * norm_weight, as kernels.rms_norm computes it.
    FP8_OUT (with ADD_NORM): y[m] rounded to the residual's dtype, then stored as E4M3 codes of
    y[m] / ys[m], ys[m] = amax / FP8_LIMIT (kernels.fp8_quant's math: Fp8Rows).
    LORA (with ADD_NORM; kernels.lora_rows): the weight's rows past num_out are every slot's A
    (engine.lora_weights), so ws[:, m, num_out + s * rank:][:rank] is row m's shrink for slot s; a row
    of slot s = lslot[m] >= 0 gets its LoRA added to p before the residual, as the norm kernel adds it."""
    if USE_PDL:  # kernels.pdl: the partial sums are the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_out
    part_ptrs = ws_ptr + m * stride_wm + cols
    y = tl.zeros([BLOCK], dtype=tl.float32)
    up = y
    for s in tl.static_range(SPLIT_K):
        y += tl.load(part_ptrs + s * stride_ws, mask=mask, other=0.0)
        if SILU_MUL:
            up += tl.load(part_ptrs + s * stride_ws + num_out, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        y = y / (1.0 + tl.exp(-y)) * up
    if ADD_NORM:
        r = tl.load(res_ptr + m * stride_rm + cols, mask=mask, other=0.0)
        p = y.to(r.dtype)
        if LORA:
            slot = tl.load(lslot_ptr + m)
            if slot >= 0:
                p = lora_row_add(p, m, cols, mask, slot, ws_ptr + num_out + slot * lora_rank, lb_ptr, ls_ptr,
                                  stride_ws, stride_wm, stride_lb_slot, lora_rank, SPLIT_K, RANK_PAD, SPLITS_PAD)
        h = (p.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(new_res_ptr + m * stride_nrm + cols, h, mask=mask)
        y = rms_norm_row(h, norm_w_ptr, cols, mask, num_out, eps)
        if FP8_OUT:
            y = y.to(r.dtype)  # what the unfused finish stores and the quantization reads
            scale = row_scale(tl.max(tl.abs(y.to(tl.float32)), axis=0), FP8_LIMIT)
            tl.store(ys_ptr + m, scale)
            y = to_codes(y, scale, FP8_LIMIT, SOFT_ROUND)
    tl.store(y_ptr + m * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


class AddNorm(NamedTuple):
    """The residual add and RMSNorm the finishing kernel applies (``skinny_linear_add_rms_norm``)."""

    residual: torch.Tensor  # [M, N], x's dtype
    norm_weight: torch.Tensor  # [N]
    eps: float
    new_residual: torch.Tensor  # [M, N], written: the projection plus the residual
    scale: torch.Tensor | None = None  # [M, 1] fp32: y holds E4M3 codes (Fp8Rows), their row scales here
    lora: LoraRows | None = None  # the weight's last rows are every slot's A (its partials unused)


def _launch_skinny(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None, y: torch.Tensor,
                   silu_mul: bool, config: tuple | None = None, add_norm: AddNorm | None = None,
                   x_scale: torch.Tensor | None = None) -> None:
    """``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k) instead of the shape rule
    (tuning, tests). A split count that would leave splits empty runs as fewer, fuller splits.
    ``add_norm``: y gets the normed sum (the finishing kernel runs even for one split).
    ``weight``: a tensor of x's dtype, or an ``Fp8Weight`` (E4M3 rows and their fp32 scales); an
    FP8 weight takes the tiles of x's dtype (its tiles hold half the bytes: the rule's shared
    memory count is an upper bound).
    ``x_scale`` (with an ``Fp8Weight``): x holds E4M3 codes, x_scale [M] or [M, 1] fp32 their per-token
    scales (``ops.quantize_rows_fp8``): the product runs on FP8 tensor cores; y's dtype is the output's."""
    if x_scale is not None:
        assert isinstance(weight, Fp8Weight) and x.dtype == weight.data.dtype, "FP8 activations take an FP8 weight"
        assert x_scale.numel() == x.shape[0] and x_scale.dtype == torch.float32 and x_scale.is_contiguous()
        weight, scale = weight
    else:
        weight, scale = _split_weight(weight, x.dtype)
    out_dtype = y.dtype
    rows_w, K = weight.shape
    assert x.dim() == 2 and x.shape[1] == K and x.stride(1) == 1, "x must be [M, K] with contiguous rows"
    M = x.shape[0]
    assert M <= MAX_M, f"a skinny GEMM takes at most {MAX_M} rows"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    num_out = gemm_out = rows_w // 2 if silu_mul else rows_w
    lora = None if add_norm is None else add_norm.lora
    if lora is not None:  # the rows past the projection's are the A stacks: their sums stay in the workspace
        num_out -= lora.b.shape[0] * lora.b.shape[2]
    assert not silu_mul or rows_w % 2 == 0, "a [gate; up] weight has an even number of rows"
    assert y.shape == (M, num_out) and y.stride(1) == 1
    assert bias is None or (not silu_mul and bias.shape == (rows_w,) and bias.stride(0) == 1)
    if add_norm is not None:
        assert not silu_mul, "the add-norm finish follows a plain projection"
        if add_norm.scale is not None:  # E4M3 codes out: the rows' dtype is the residual's
            assert y.dtype == FP8_DTYPE and add_norm.scale.shape == (M, 1) and add_norm.scale.is_contiguous()
            out_dtype = add_norm.residual.dtype
        for t in (add_norm.residual, add_norm.new_residual):
            assert t.shape == (M, num_out) and t.stride(1) == 1 and t.dtype == out_dtype
        assert add_norm.norm_weight.shape == (num_out,) and add_norm.norm_weight.stride(0) == 1
    if M == 0 or num_out == 0:
        return
    if K == 0:  # an empty sum (and silu(0) * 0 = 0)
        assert add_norm is None, "the add-norm finish needs K > 0"
        y.copy_(bias.expand(M, num_out)) if bias is not None else y.zero_()
        return
    block_n, block_k, num_warps, num_stages, split_k = config or tile_config(
        M, rows_w, K, silu_mul, x.element_size(), num_sms(x.device), fp8_mma=x_scale is not None)
    tiles_per_split = triton.cdiv(triton.cdiv(K, block_k), split_k)
    split_k = triton.cdiv(triton.cdiv(K, block_k), tiles_per_split)  # e.g. 4 tiles in 3 splits: 2 + 2
    workspace = split_k > 1 or add_norm is not None
    # the workspace comes from the caching allocator: no sync, and fine inside CUDA graph capture
    out = torch.empty((split_k, M, rows_w), dtype=torch.float32, device=y.device) if workspace else y
    dummy_bias = bias if bias is not None else out  # never read without HAS_BIAS
    fp8 = {} if scale is None else {"s_ptr": scale, "W_SCALED": True}
    if x_scale is not None:
        fp8.update(xs_ptr=x_scale, X_SCALED=True)
    _skinny_kernel[(triton.cdiv(gemm_out, block_n), split_k)](
        x, weight, dummy_bias, out, M, gemm_out, K, x.stride(0), weight.stride(0), out.stride(-2),
        out.stride(0) if workspace else 0, tiles_per_split,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, WORKSPACE=workspace,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=upcast_bf16_dot(x.dtype) or (x_scale is not None and soft_round()),
        num_warps=num_warps, num_stages=num_stages, **launch_options(x), **fp8,
    )
    if not workspace:
        return
    if add_norm is None:
        block, finish_warps = min(1024, triton.next_power_of_2(num_out)), 4
        res = norm_w = new_res = y  # unused without ADD_NORM
        eps, y_scale = 0.0, None
    else:
        block = triton.next_power_of_2(num_out)  # the whole row: its sum of squares
        finish_warps = max(4, row_num_warps(block))
        res, norm_w, eps, new_res, y_scale, _ = add_norm
    fp8_out = {} if y_scale is None else {"FP8_OUT": True, "FP8_LIMIT": FP8_MAX, "SOFT_ROUND": soft_round()}
    if lora is not None:
        assert lora.b.shape[1] == num_out and lora.row_slots.shape == (M,) and lora.slot_stride == lora.b.shape[2]
        fp8_out.update(LORA=True, lb_ptr=lora.b, ls_ptr=lora.scales, lslot_ptr=lora.row_slots,
                       stride_lb_slot=lora.b.stride(0), lora_rank=lora.b.shape[2],
                       RANK_PAD=triton.next_power_of_2(lora.b.shape[2]), SPLITS_PAD=triton.next_power_of_2(split_k))
    _split_sum_kernel[(M, triton.cdiv(num_out, block))](
        out, dummy_bias, y, res, norm_w, new_res, y if y_scale is None else y_scale, num_out, out.stride(0), out.stride(1), y.stride(0),
        res.stride(0), new_res.stride(0), float(eps),
        SPLIT_K=split_k, BLOCK=block, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None,
        num_warps=finish_warps, **fp8_out, **launch_options(x),
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
                  x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 128); weight: [N, K] (or its FP8 form) -> x @ weight.T (+ bias): [M, N].
    ``x_scale``: x is E4M3 codes with per-token scales (FP8 tensor cores); the output is ``out_dtype``."""
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    _launch_skinny(x, weight, bias, y, silu_mul=False, x_scale=x_scale)
    return y


def skinny_linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, residual: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float, x_scale: torch.Tensor | None = None,
                               fp8_out: bool = False, lora: LoraRows | None = None
                               ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """x: [M, K] (M <= 128); weight: [N, K]; residual: [M, N] -> (rms_norm(h) * norm_weight, h) with
    h = x @ weight.T + residual (each rounded to the residual's dtype): a projection, the residual add
    and the next RMSNorm, in the GEMM and its finishing kernel. ``x_scale``: as skinny_linear's.
    ``fp8_out``: the normed rows quantized per token by the finishing kernel (Fp8Rows,
    ``reference.quantize_rows_fp8``'s math on what it would have stored). ``lora``: weight's rows
    past the residual's columns are every slot's A; each adapter row's LoRA is added before the add."""
    M, num_out = x.shape[0], residual.shape[1]
    y = torch.empty((M, num_out), dtype=FP8_DTYPE if fp8_out else residual.dtype, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device) if fp8_out else None
    new_residual = torch.empty((M, num_out), dtype=residual.dtype, device=x.device)
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    _launch_skinny(x, weight, None, y, silu_mul=False, x_scale=x_scale,
                   add_norm=AddNorm(residual, norm_weight.contiguous(), float(eps), new_residual, scale, lora))
    return (Fp8Rows(y, scale, residual.dtype) if fp8_out else y), new_residual


def skinny_silu_mul(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, x_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 128); weight: [2I, K] = [gate; up] (or its FP8 form) -> silu(x @ gate.T) * (x @ up.T): [M, I].
    ``x_scale``: as skinny_linear's."""
    y = torch.empty((x.shape[0], weight.shape[0] // 2), dtype=out_dtype or x.dtype, device=x.device)
    _launch_skinny(x, weight, None, y, silu_mul=True, x_scale=x_scale)
    return y
