"""Stream-K skinny matrix products for decode batches, Triton: kernels.skinny_gemm's
tiles with the work dealt evenly to one wave of programs.

    linear:    y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n])
    silu-mul:  W = [gate; up] (2I rows): y[m, i] = silu(g[m, i]) * u[m, i]

A projection at a few dozen tokens is a weight read cut into row blocks x K
tiles. One program per row block (or per row block and K split) leaves the last
wave part-filled: llama2-7b's qkv at 64-row blocks is 192 programs on 132 SMs,
a second wave 60 wide, and the sweep could only tie cuBLAS. Here the (row block,
K tile) units, row block after row block, are dealt to one wave of programs in
equal contiguous ranges, so every program streams the same weight bytes:

    unit u = rb * k_tiles + kt;   program p takes units [p * per, min((p + 1) * per, total))
    contributors of row block rb: first(rb) = rb * k_tiles // per .. last(rb) = ((rb + 1) * k_tiles - 1) // per

A row block with one contributor is finished in place. Of a shared one, each
contributor q writes its fp32 partial sums to its own workspace slot (slot 1 if
q == first(rb): it is q's last segment; else slot 0: q's first), then counts
itself in on the counter of first(rb) (acq_rel at GPU scope, after a barrier);
the one that brings the count to last - first + 1 adds the slots in program
order (the same sum whatever the arrival order), finishes (bias, SiLU·mul, cast)
and resets the counter to 0. The counters are a zeroed buffer per device that
every launch leaves zeroed, so the kernels of one device run one at a time
(one stream), as a decode step's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dot import dot, upcast_bf16_dot
from kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options
from kernels.skinny_gemm import check_skinny_args, tile_config as _skinny_tiles

_scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (slots, counters)


@triton.jit
def _finish(acc, acc_up, rows, row_mask, tokens, token_mask, b_ptr, y_ptr, stride_ym,
            HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    """y[m, n] = acc[n, m] (+ b[n]), or silu(acc[n, m]) * acc_up[n, m]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(y_ptr + tokens[None, :] * stride_ym + rows[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & token_mask[None, :])


@triton.jit
def _stream_k_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, slots_ptr, counts_ptr,
    M, num_out, K, stride_xm, stride_wn, stride_ym, up_offset, k_tiles, per, total,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SLOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Program p: for each row block rb its units [p * per, (p + 1) * per) meet, over the K tiles
    kt of that range: acc[n, m] = sum W[rb * BLOCK_N + n, k] x[m, k] (and acc_up over the up rows
    up_offset + ...), finished in place or through the slots (module docstring). SLOT: the fp32
    elements of one slot (BLOCK_N * BLOCK_M, twice with SILU_MUL)."""
    if USE_PDL:  # the slots and counters are the previous kernel's too: wait before any access
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    token_mask = tokens < M  # padding tokens read as 0, never stored
    cols = tl.arange(0, BLOCK_K)
    tile = offs_n[:, None] * BLOCK_M + tokens[None, :]  # [n, m] within a slot
    unit = pid * per
    end = tl.minimum(unit + per, total)
    while unit < end:
        rb = unit // k_tiles
        seg_end = tl.minimum(end, (rb + 1) * k_tiles)
        rows = rb * BLOCK_N + offs_n
        row_mask = rows < num_out
        rows = tl.where(row_mask, rows, 0).to(tl.int64)  # masked rows read row 0, never stored
        gate_ptrs = w_ptr + rows[:, None] * stride_wn + cols[None, :]
        up_ptrs = w_ptr + (rows + up_offset)[:, None] * stride_wn + cols[None, :]
        x_ptrs = x_ptr + tokens[:, None] * stride_xm + cols[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kt in range(unit - rb * k_tiles, seg_end - rb * k_tiles):
            k0 = kt * BLOCK_K
            if EVEN_K:
                w = tl.load(gate_ptrs + k0)
                x = tl.load(x_ptrs + k0, mask=token_mask[:, None], other=0.0)
            else:
                in_k = k0 + cols < K
                w = tl.load(gate_ptrs + k0, mask=in_k[None, :], other=0.0)
                x = tl.load(x_ptrs + k0, mask=token_mask[:, None] & in_k[None, :], other=0.0)
            acc += dot(w, tl.trans(x), DOT_PRECISION, DOT_UPCAST)
            if SILU_MUL:
                if EVEN_K:
                    u = tl.load(up_ptrs + k0)
                else:
                    u = tl.load(up_ptrs + k0, mask=in_k[None, :], other=0.0)
                acc_up += dot(u, tl.trans(x), DOT_PRECISION, DOT_UPCAST)
        first = rb * k_tiles // per
        last = ((rb + 1) * k_tiles - 1) // per
        if first == last:  # the whole row block was this program's
            _finish(acc, acc_up, rows, row_mask, tokens, token_mask, b_ptr, y_ptr, stride_ym, HAS_BIAS, SILU_MUL)
        else:
            mine = slots_ptr + (pid * 2 + (pid == first).to(tl.int32)).to(tl.int64) * SLOT + tile
            tl.store(mine, acc)
            if SILU_MUL:
                tl.store(mine + BLOCK_N * BLOCK_M, acc_up)
            tl.debug_barrier()  # every thread's partial sums are written before the count goes up
            arrived = tl.atomic_add(counts_ptr + first, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:  # the last contributor: add every slot, in program order
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for q in range(first, last + 1):
                    theirs = slots_ptr + (q * 2 + (q == first).to(tl.int32)).to(tl.int64) * SLOT + tile
                    acc += tl.load(theirs, cache_modifier=".cg")  # from L2: another SM wrote it
                    if SILU_MUL:
                        acc_up += tl.load(theirs + BLOCK_N * BLOCK_M, cache_modifier=".cg")
                _finish(acc, acc_up, rows, row_mask, tokens, token_mask, b_ptr, y_ptr, stride_ym,
                        HAS_BIAS, SILU_MUL)
                tl.atomic_xchg(counts_ptr + first, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        unit = seg_end


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that row blocks are shared
    return torch.cuda.get_device_properties(device).multi_processor_count


def _scratch_for(device: torch.device, slot_elems: int, programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's slots (>= 2 per program) and zeroed counters (>= 1 per program), grown on
    demand. The engine runs every CUDA graph bucket eagerly before capturing, so the largest
    need is met before any capture."""
    slots, counts = _scratch.get(device, (None, None))
    if slots is None or slots.numel() < 2 * programs * slot_elems or counts.numel() < programs:
        slots = torch.empty(2 * programs * slot_elems, dtype=torch.float32, device=device)
        counts = torch.zeros(programs, dtype=torch.int32, device=device)
        _scratch[device] = (slots, counts)
    return slots, counts


def tile_config(M: int, N: int, K: int, silu_mul: bool, elem_size: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM): kernels.skinny_gemm's tiles (one
    program per SM fits their shared memory). Not yet measured on a GPU."""
    block_n, block_k, num_warps, num_stages, _ = _skinny_tiles(M, N, K, silu_mul, elem_size)
    return block_n, block_k, num_warps, num_stages, 1


def _launch_stream_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                     silu_mul: bool, config: tuple | None = None, num_sms: int | None = None) -> None:
    """``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM) instead of the rule;
    ``num_sms`` instead of the device's (tests)."""
    M, num_out, K = check_skinny_args(x, weight, bias, y, silu_mul)
    if M == 0 or num_out == 0:
        return
    if K == 0:  # an empty sum (and silu(0) * 0 = 0)
        y.copy_(bias.expand(M, num_out)) if bias is not None else y.zero_()
        return
    block_n, block_k, num_warps, num_stages, per_sm = config or tile_config(M, weight.shape[0], K, silu_mul,
                                                                            x.element_size())
    block_m = max(16, triton.next_power_of_2(M))
    k_tiles = triton.cdiv(K, block_k)
    total = triton.cdiv(num_out, block_n) * k_tiles
    per = triton.cdiv(total, min(total, (num_sms or _num_sms(x.device)) * per_sm))
    programs = triton.cdiv(total, per)  # none empty
    slot = (2 if silu_mul else 1) * block_n * block_m
    slots, counts = _scratch_for(x.device, slot, programs)
    _stream_k_kernel[(programs,)](
        x, weight, bias if bias is not None else y, y, slots, counts,
        M, num_out, K, x.stride(0), weight.stride(0), y.stride(0), num_out, k_tiles, per, total,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SLOT=slot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", DOT_UPCAST=upcast_bf16_dot(x.dtype),
        num_warps=num_warps, num_stages=num_stages, **launch_options(x),
    )


def stream_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (M <= 128); weight: [N, K] -> x @ weight.T (+ bias): [M, N]."""
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch_stream_k(x, weight, bias, y, silu_mul=False)
    return y


def stream_k_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K] (M <= 128); weight: [2I, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T): [M, I]."""
    y = torch.empty((x.shape[0], weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    _launch_stream_k(x, weight, None, y, silu_mul=True)
    return y
