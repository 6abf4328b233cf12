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


# F16_PRODUCTS' scale of x (exact): a product |x * e4m3| / 64 stays within fp16 up to |x| = 9,362
# (a normalized activation is at most sqrt(hidden) times its norm weight: 64x at 4096), and stays
# a normal fp16 number down to |x * e4m3| = 0.004.
X_F16_SHIFT = tl.constexpr(1.0 / 64)


@triton.jit
def _mac(acc, w, x, F16_PRODUCTS: tl.constexpr):
    """acc + w * x: fp32, or (F16_PRODUCTS) f16x2 on x already in fp16."""
    if F16_PRODUCTS:
        acc = acc + w.to(tl.float16) * x[None, :]
    else:
        acc = acc + w.to(tl.float32) * x[None, :]
    return acc


@triton.jit
def _load_x(ptrs, mask, F16_PRODUCTS: tl.constexpr):
    """x's tile in the accumulation's form: fp32, or (F16_PRODUCTS) fp16 times X_F16_SHIFT."""
    if mask is None:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if F16_PRODUCTS:
        x = (x * X_F16_SHIFT).to(tl.float16)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, num_out, K, stride_wn, up_offset,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr = False,
    s_ptr=None, W_SCALED: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    F16_PRODUCTS: tl.constexpr = False,
):
    """y[n] = sum_k x[k] W[n, k] (+ b[n]) for n in this program's BLOCK_N rows, fp32 accumulation;
    SILU_MUL: y[n] = silu(sum_k x[k] W[n, k]) * sum_k x[k] W[up_offset + n, k].
    W_SCALED (FP8 weights): W[n, k] = w[n, k] * s[n], each row's sum times s[n] before the bias.
    PREFETCH: tile i+1's loads issued before tile i's math (two tiles in flight a warp, twice
    the registers); a tuning form (``config``'s fifth field), in no rule yet.
    F16_PRODUCTS (FP8 weights; ``config``'s sixth field): the products and their sum across tiles
    in f16x2 (one conversion and one FMA per two elements, against a conversion to fp32 and an
    fp32 FMA per element), x taken as fp16 times X_F16_SHIFT so that no partial sum overflows;
    the lanes' partials are summed in fp32 at the end. Each partial holds K / BLOCK_K products.

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
    x = _load_x(x_ptr + cols, first, F16_PRODUCTS)
    acc_dtype = tl.float16 if F16_PRODUCTS else tl.float32
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=acc_dtype)
    acc_up = acc
    if not PREFETCH:
        acc = _mac(acc, w, x, F16_PRODUCTS)
        if SILU_MUL:
            acc_up = _mac(acc_up, u, x, F16_PRODUCTS)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if PREFETCH:  # each tile's loads issued before the previous tile's math: two tiles in flight a warp
            w_cur, u_cur, x_cur = w, u, x
        # the weight tiles first: issued before x's move to the tile's layout (FP8: through shared
        # memory, between barriers), not after it (tests/kernels/gemv_ptx_check.py)
        if EVEN_K:
            w = tl.load(gate_ptrs + k0)
            if SILU_MUL:
                u = tl.load(up_ptrs + k0)
            x = _load_x(x_ptr + k0 + cols, None, F16_PRODUCTS)
        else:
            kmask = k0 + cols < K
            w = tl.load(gate_ptrs + k0, mask=kmask[None, :], other=0.0)
            if SILU_MUL:
                u = tl.load(up_ptrs + k0, mask=kmask[None, :], other=0.0)
            x = _load_x(x_ptr + k0 + cols, kmask, F16_PRODUCTS)
        if PREFETCH:
            acc = _mac(acc, w_cur, x_cur, F16_PRODUCTS)
            if SILU_MUL:
                acc_up = _mac(acc_up, u_cur, x_cur, F16_PRODUCTS)
        else:
            acc = _mac(acc, w, x, F16_PRODUCTS)
            if SILU_MUL:
                acc_up = _mac(acc_up, u, x, F16_PRODUCTS)
    if PREFETCH:  # the last tile
        acc = _mac(acc, w, x, F16_PRODUCTS)
        if SILU_MUL:
            acc_up = _mac(acc_up, u, x, F16_PRODUCTS)
    y = tl.sum(acc.to(tl.float32), axis=1)
    up = tl.sum(acc_up.to(tl.float32), axis=1)
    if F16_PRODUCTS:
        y /= X_F16_SHIFT
        up /= X_F16_SHIFT
    if W_SCALED:  # the rows' scales: constants, read once (masked rows read row 0's)
        y *= tl.load(s_ptr + rows)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    if SILU_MUL:
        if W_SCALED:
            y = y / (1.0 + tl.exp(-y)) * (up * tl.load(s_ptr + rows + up_offset))
        else:
            y = y / (1.0 + tl.exp(-y)) * up
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def tile_config(num_out: int, K: int, silu_mul: bool, fp8: bool = False) -> tuple:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages[, PREFETCH, F16_PRODUCTS]) from shapes only.

    From ``tandem.bench.tune_gemv`` on an H200 (cold L2, 14 projection shapes of llama3.2-1b,
    llama2-7b and llama3-8b): 4 whole rows of 1024-wide tiles per program were best or
    within 3% for K <= 8192; the down projections (K of 11008, 14336) want 8 rows; the
    fused gate/up form, two accumulators, 512-wide tiles and 3 stages.

    FP8 weights (``fp8``; one H200, 2026-12-02, ``python3 -m tandem.bench.tune_fp8 --parts gemv``,
    llama3-8b, 72 settings a projection, docs/kernels.md): 1024-wide tiles with f16x2 products
    (F16_PRODUCTS) for qkv (16 rows on 8 warps: 9.95 -> 8.22 us), gate/up (4 rows: 34.36 -> 33.70)
    and down (4 rows: 17.98 -> 17.06); o (at most 4096 x 4096) keeps 8 rows of 1024 in fp32
    (6.03 us, the sweep's best).
    """
    if fp8:
        if silu_mul:
            return 4, min(1024, triton.next_power_of_2(K)), 4, 2, False, True
        if num_out <= 4096 and K <= 4096:
            return 8, min(1024, triton.next_power_of_2(K)), 4, 2
        if K > 8192:
            return 4, min(1024, triton.next_power_of_2(K)), 4, 2, False, True
        return 16, min(1024, triton.next_power_of_2(K)), 8, 2, False, True
    if silu_mul:
        return 4, min(512, triton.next_power_of_2(K)), 4, 3
    return (8 if K > 8192 else 4), min(1024, triton.next_power_of_2(K)), 4, 2


def _launch_gemv(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None, y: torch.Tensor,
                 silu_mul: bool, config: tuple | None = None) -> None:
    """``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages[, PREFETCH[, F16_PRODUCTS]]) instead of the
    shape rule (tuning only; F16_PRODUCTS applies to FP8 weights).
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
    # f16x2 products for 16-bit activations; an fp32 model keeps fp32 products under any rule
    f16 = len(forms) > 1 and bool(forms[1]) and (config is not None or x.dtype != torch.float32)
    fp8 = {} if scale is None else {"s_ptr": scale, "W_SCALED": True, "F16_PRODUCTS": f16}
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
