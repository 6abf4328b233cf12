"""Matrix-vector products for one token (decode at batch 1), Triton.

    linear:        y[n] = sum_k x[k] * W[n, k] (+ b[n])
    silu-mul:      W = [gate; up] (2I rows): y[i] = silu(g_i) * u_i,  g = W[:I] x,  u = W[I:] x

At one token a projection is a pure weight read: each program streams BLOCK_N
whole rows of W (contiguous along K, so every load is a full line) and keeps
BLOCK_N x BLOCK_K fp32 partial products in registers, summed once at the end.
The silu-mul form computes the gate and up rows of the same outputs in one
program and writes only the activation: the SiLU kernel and the [2I] round trip
through memory are gone.

FP8 weights (``kernels.fp8_weight.Fp8Weight``: E4M3 rows, one fp32 scale per row) run
the same loop over half the bytes: each E4M3 value is widened to fp32 in registers
(exact), the products accumulate in fp32, and each row's sum is multiplied by its
scale once at the end (before the bias and SiLU·mul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_weight import FP8_DTYPE, Fp8Weight
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, num_out, K, stride_wn, up_offset,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr = False,
    s_ptr=None, W_SCALED: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """y[n] = sum_k x[k] W[n, k] (+ b[n]) for n in this program's BLOCK_N rows, fp32 accumulation;
    SILU_MUL: y[n] = silu(sum_k x[k] W[n, k]) * sum_k x[k] W[up_offset + n, k].
    W_SCALED (FP8 weights): W[n, k] = w[n, k] * s[n], each row's sum times s[n] before the bias.
    PREFETCH: tile i+1's loads issued before tile i's math (two tiles in flight a warp, twice
    the registers); a tuning form (``config``'s fifth field), in no rule yet.

    The first weight tile is loaded before waiting for the previous kernel (kernels.pdl):
    weights are constant, only x comes from it (so no kernel that triggers its dependents
    early may write a weight).
    num_stages made no difference to the compiled loop with Triton 3.9 (the loads are not
    pipelined across iterations); the sweep's differences between stages were within noise.
    """
    if USE_PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_out
    rows = tl.where(row_mask, rows, 0).to(tl.int64)  # masked rows read row 0, never stored
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + rows[:, None] * stride_wn + cols[None, :]
    up_ptrs = w_ptr + (rows + up_offset)[:, None] * stride_wn + cols[None, :]  # int64 row offsets
    first = cols < K
    w = tl.load(gate_ptrs, mask=first[None, :], other=0.0)
    u = w
    if SILU_MUL:
        u = tl.load(up_ptrs, mask=first[None, :], other=0.0)
    if USE_PDL:
        gdc_wait()
    x = tl.load(x_ptr + cols, mask=first, other=0.0).to(tl.float32)
    if PREFETCH:  # each tile's loads issued before the previous tile's math: two tiles in flight a warp
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = acc
    else:
        acc = w.to(tl.float32) * x[None, :]
        acc_up = u.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if PREFETCH:
            w_cur, u_cur, x_cur = w, u, x
        # the weight tiles first: issued before x's move to the tile's layout (FP8: through shared
        # memory, between barriers), not after it (tests/kernels/gemv_ptx_check.py)
        if EVEN_K:
            w = tl.load(gate_ptrs + k0)
            if SILU_MUL:
                u = tl.load(up_ptrs + k0)
            x = tl.load(x_ptr + k0 + cols).to(tl.float32)
        else:
            kmask = k0 + cols < K
            w = tl.load(gate_ptrs + k0, mask=kmask[None, :], other=0.0)
            if SILU_MUL:
                u = tl.load(up_ptrs + k0, mask=kmask[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0).to(tl.float32)
        if PREFETCH:
            acc += w_cur.to(tl.float32) * x_cur[None, :]
            if SILU_MUL:
                acc_up += u_cur.to(tl.float32) * x_cur[None, :]
        else:
            acc += w.to(tl.float32) * x[None, :]
            if SILU_MUL:
                acc_up += u.to(tl.float32) * x[None, :]
    if PREFETCH:  # the last tile
        acc += w.to(tl.float32) * x[None, :]
        if SILU_MUL:
            acc_up += u.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if W_SCALED:  # the rows' scales: constants, read once (masked rows read row 0's)
        y *= tl.load(s_ptr + rows)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    if SILU_MUL:
        if W_SCALED:
            y = y / (1.0 + tl.exp(-y)) * (tl.sum(acc_up, axis=1) * tl.load(s_ptr + rows + up_offset))
        else:
            y = y / (1.0 + tl.exp(-y)) * tl.sum(acc_up, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def tile_config(num_out: int, K: int, silu_mul: bool, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) from shapes only.

    From ``tandem.bench.tune_gemv`` on an H200 (cold L2, 14 projection shapes of llama3.2-1b,
    llama2-7b and llama3-8b): 4 whole rows of 1024-wide tiles per program were best or
    within 3% for K <= 8192; the down projections (K of 11008, 14336) want 8 rows; the
    fused gate/up form, two accumulators, 512-wide tiles and 3 stages.

    FP8 weights (``fp8``; one H200, 2026-12-02, ``python3 -m tandem.bench.tune_fp8 --parts gemv``,
    llama3-8b, docs/kernels.md): 2048-wide tiles of 4 rows (the bf16 rule's bytes per tile) for qkv
    (10.4 -> 9.8 us) and down (22.4 -> 19.6); 8 rows of 1024 where the weight is at most 4096 x 4096
    (o: 9.0 -> 6.5); gate/up keeps the bf16 rule (37.0 us, the best of the sweep).
    """
    if silu_mul:
        return 4, min(512, triton.next_power_of_2(K)), 4, 3
    if fp8:
        if num_out <= 4096 and K <= 4096:
            return 8, min(1024, triton.next_power_of_2(K)), 4, 2
        return 4, min(2048, triton.next_power_of_2(K)), 4, 2
    return (8 if K > 8192 else 4), min(1024, triton.next_power_of_2(K)), 4, 2


def _launch_gemv(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None, y: torch.Tensor,
                 silu_mul: bool, config: tuple | None = None) -> None:
    """``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages) instead of the shape rule (tuning only).
    ``weight``: a tensor of x's dtype, or an ``Fp8Weight`` (E4M3 rows and their fp32 scales)."""
    weight, scale = _split_weight(weight, x.dtype)
    rows_w, K = weight.shape
    assert x.shape == (K,) and x.stride(0) == 1, "x must be one contiguous [K] row"
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    num_out = rows_w // 2 if silu_mul else rows_w
    assert not silu_mul or rows_w % 2 == 0, "a [gate; up] weight has an even number of rows"
    assert y.shape == (num_out,) and y.stride(0) == 1
    assert bias is None or (not silu_mul and bias.shape == (rows_w,) and bias.stride(0) == 1)
    if num_out == 0:
        return
    if K == 0:  # an empty sum (and silu(0) * 0 = 0)
        y.copy_(bias) if bias is not None else y.zero_()
        return
    block_n, block_k, num_warps, num_stages, *forms = config or tile_config(num_out, K, silu_mul, scale is not None)
    prefetch = bool(forms and forms[0])
    fp8 = {} if scale is None else {"s_ptr": scale, "W_SCALED": True}
    _gemv_kernel[(triton.cdiv(num_out, block_n),)](
        x, weight, bias if bias is not None else y, y, num_out, K, weight.stride(0), num_out,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, num_warps=num_warps, num_stages=num_stages,
        PREFETCH=prefetch, **launch_options(x), **fp8,
    )


def _split_weight(weight: torch.Tensor | Fp8Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (the [N, K] matrix the kernel streams, its per-row fp32 scales or None), checked against x's dtype."""
    if not isinstance(weight, Fp8Weight):
        assert weight.dtype == dtype, "x and the weight must share a dtype"
        return weight, None
    data, scale = weight
    assert data.dtype == FP8_DTYPE, "an Fp8Weight holds float8_e4m3fn rows"
    assert scale.shape == (data.shape[0],) and scale.dtype == torch.float32 and scale.stride(0) == 1, \
        "an Fp8Weight's scales: [N] contiguous fp32"
    return data, scale


def gemv(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] or [K]; weight: [N, K] (or its FP8 form) -> x @ weight.T (+ bias) with x's leading shape."""
    y = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch_gemv(x.reshape(-1).contiguous(), weight, bias, y.view(-1), silu_mul=False)
    return y


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x: [1, K] or [K]; weight: [2I, K] = [gate; up] (or its FP8 form) -> silu(x @ gate.T) * (x @ up.T): [..., I]."""
    y = torch.empty((*x.shape[:-1], weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    _launch_gemv(x.reshape(-1).contiguous(), weight, None, y.view(-1), silu_mul=True)
    return y
