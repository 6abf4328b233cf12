"""SiLU-and-multiply of the gate/up projection (Triton).

    x = [gate | up]  (last dim 2 * inter)  ->  silu(gate) * up

``silu_mul_fp8`` writes the product (rounded to x.dtype) in the per-token FP8 form an FP8 matmul
takes (``kernels.fp8_quant``'s math): one program a row, a pass for the row's amax and a second
(x again, from L2) for the codes, so the down projection runs no quantization pass of its own.
With ``lora`` (the gate's and the up's ``kernels.lora_rows.LoraRows``, ``gate_up_rows``) each
adapter row's LoRA is added to both halves first (``lora_row_add``, as the norms add o's and
down's), so gate/up's expand is no launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_kv import soft_round
from tandem.kernels.fp8_quant import row_scale, to_codes
from tandem.kernels.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Rows
from tandem.kernels.lora_rows import LoraRows, check
from tandem.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options
from tandem.kernels.rms_norm import lora_row_add

# the LoRA arguments of both kernels: per row its slot; per part (gate, up) the shrinks, B and scales
_LORA_ARGS = ("lslot_ptr", "lpg_ptr", "lpu_ptr", "lbg_ptr", "lbu_ptr", "lsg_ptr", "lsu_ptr")


@triton.jit
def _add_lora(gate, up, row, cols, mask, lslot_ptr, lpg_ptr, lpu_ptr, lbg_ptr, lbu_ptr, lsg_ptr, lsu_ptr,
              stride_lp_row, stride_lb_slot, slot_stride, lora_rank, RANK_PAD: tl.constexpr):
    """A row's gate and up halves with its slot's LoRA of each added (a row of slot -1: as they are)."""
    slot = tl.load(lslot_ptr + row)
    if slot >= 0:
        gate = lora_row_add(gate, row, cols, mask, slot, lpg_ptr + slot * slot_stride, lbg_ptr, lsg_ptr, 0,
                            stride_lp_row, stride_lb_slot, lora_rank, 1, RANK_PAD, 1)
        up = lora_row_add(up, row, cols, mask, slot, lpu_ptr + slot * slot_stride, lbu_ptr, lsu_ptr, 0,
                          stride_lp_row, stride_lb_slot, lora_rank, 1, RANK_PAD, 1)
    return gate, up


@triton.jit(do_not_specialize=["stride_lp_row", "stride_lb_slot", "slot_stride", "lora_rank"])
def _silu_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
    lslot_ptr=None, lpg_ptr=None, lpu_ptr=None, lbg_ptr=None, lbu_ptr=None, lsg_ptr=None, lsu_ptr=None,
    stride_lp_row=0, stride_lb_slot=0, slot_stride=0, lora_rank=0, LORA: tl.constexpr = False,
    RANK_PAD: tl.constexpr = 16,
):
    """out[r, c] = g / (1 + exp(-g)) * u   with g = x[r, c], u = x[r, inter + c], in fp32.
    LORA: g and u first get row r's LoRA of each half (``_add_lora``), rounded to x's dtype."""
    if USE_PDL:  # kernels.pdl: let the next kernel launch, then wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    if LORA:
        gate, up = _add_lora(gate, up, row, cols, mask, lslot_ptr, lpg_ptr, lpu_ptr, lbg_ptr, lbu_ptr, lsg_ptr,
                             lsu_ptr, stride_lp_row, stride_lb_slot, slot_stride, lora_rank, RANK_PAD)
    g = gate.to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_row(x_row, row, cols, mask, inter, lslot_ptr, lpg_ptr, lpu_ptr, lbg_ptr, lbu_ptr, lsg_ptr, lsu_ptr,
                  stride_lp_row, stride_lb_slot, slot_stride, lora_rank, LORA: tl.constexpr, RANK_PAD: tl.constexpr):
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0)
    if LORA:
        gate, up = _add_lora(gate, up, row, cols, mask, lslot_ptr, lpg_ptr, lpu_ptr, lbg_ptr, lbu_ptr, lsg_ptr,
                             lsu_ptr, stride_lp_row, stride_lb_slot, slot_stride, lora_rank, RANK_PAD)
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(gate.dtype)  # rounded as silu_mul stores it


@triton.jit(do_not_specialize=["stride_lp_row", "stride_lb_slot", "slot_stride", "lora_rank"])
def _silu_mul_fp8_kernel(
    x_ptr, q_ptr, s_ptr, values_ptr, stride_x, stride_q, inter,
    BLOCK: tl.constexpr, FP8_LIMIT: tl.constexpr, SOFT_ROUND: tl.constexpr, USE_PDL: tl.constexpr = False,
    KEEP_VALUES: tl.constexpr = False,
    lslot_ptr=None, lpg_ptr=None, lpu_ptr=None, lbg_ptr=None, lbu_ptr=None, lsg_ptr=None, lsu_ptr=None,
    stride_lp_row=0, stride_lb_slot=0, slot_stride=0, lora_rank=0, LORA: tl.constexpr = False,
    RANK_PAD: tl.constexpr = 16,
):
    """Row r: a = silu(gate) * up rounded to x's dtype (as _silu_mul_kernel, LORA included);
    s[r] = amax(|a|) / FP8_LIMIT (1 for zeros), q[r] = E4M3(a / s[r]); KEEP_VALUES: a stored to
    values[r] too (row stride stride_q)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + offs
        a = _silu_mul_row(x_row, row, cols, cols < inter, inter, lslot_ptr, lpg_ptr, lpu_ptr, lbg_ptr, lbu_ptr,
                          lsg_ptr, lsu_ptr, stride_lp_row, stride_lb_slot, slot_stride, lora_rank, LORA, RANK_PAD)
        if KEEP_VALUES:
            tl.store(values_ptr + row * stride_q + cols, a, mask=cols < inter)
        amax = tl.maximum(amax, tl.abs(a.to(tl.float32)))
    scale = row_scale(tl.max(amax, axis=0), FP8_LIMIT)
    tl.store(s_ptr + row, scale)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + offs
        mask = cols < inter
        a = _silu_mul_row(x_row, row, cols, mask, inter, lslot_ptr, lpg_ptr, lpu_ptr, lbg_ptr, lbu_ptr,
                          lsg_ptr, lsu_ptr, stride_lp_row, stride_lb_slot, slot_stride, lora_rank, LORA, RANK_PAD)
        tl.store(q_ptr + row * stride_q + cols, to_codes(a, scale, FP8_LIMIT, SOFT_ROUND), mask=mask)


def _lora_arguments(x2d: torch.Tensor, lora: tuple[LoraRows, LoraRows] | None) -> dict:
    """The kernels' LoRA keywords for ``lora`` (the gate's and the up's rows, lora_rows.gate_up_rows)."""
    if lora is None:
        return {}
    gate, up = lora
    inter = x2d.shape[1] // 2
    for part in lora:
        check(x2d[:, :inter], part)
        assert part.slot_stride and part.partials.stride(1) == gate.partials.stride(1)
        assert part.b.stride(0) == gate.b.stride(0) and part.slot_stride == gate.slot_stride
    assert gate.b.shape == up.b.shape and gate.row_slots is up.row_slots, "the two halves of one step's rows"
    pointers = (gate.row_slots, gate.partials, up.partials, gate.b, up.b, gate.scales, up.scales)
    rank = gate.b.shape[2]
    return dict(zip(_LORA_ARGS, pointers), stride_lp_row=gate.partials.stride(1), stride_lb_slot=gate.b.stride(0),
                slot_stride=gate.slot_stride, lora_rank=rank, LORA=True, RANK_PAD=triton.next_power_of_2(rank))


def _launch_silu_mul(x2d: torch.Tensor, out2d: torch.Tensor, lora: tuple[LoraRows, LoraRows] | None = None) -> None:
    num_rows, width = x2d.shape
    assert width % 2 == 0, "last dim must be 2 * intermediate size"
    assert x2d.stride(1) == 1 and out2d.stride(1) == 1, "last dim must be contiguous"
    inter = width // 2
    if num_rows == 0 or inter == 0:
        return
    # with LoRA 4 columns a thread, not 8: each column also sums its two halves' rank terms (sm90:
    # 158 registers at 8 a thread)
    block = min(1024 if lora is not None else 2048, triton.next_power_of_2(inter))
    num_warps = max(1, min(8, block // (128 if lora is not None else 256)))
    grid = (num_rows, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](
        x2d, out2d, x2d.stride(0), out2d.stride(0), inter, BLOCK=block, num_warps=num_warps,
        **_lora_arguments(x2d, lora), **launch_options(x2d),
    )


def silu_mul(x: torch.Tensor, lora: tuple[LoraRows, LoraRows] | None = None) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] (gate | up) -> silu(gate) * up: [num_tokens, inter]; ``lora`` as the
    reference's."""
    inter = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)  # [..., inter]
    if lora is not None:
        assert x.dim() == 2, "a step's rows: LoRA reads each row's slot"
    _launch_silu_mul(x2d, out.view(-1, inter), lora)
    return out


def silu_mul_fp8(x: torch.Tensor, keep_values: bool = False, lora: tuple[LoraRows, LoraRows] | None = None) -> Fp8Rows:
    """As ``reference.silu_mul_fp8``: x [T, 2 * inter] -> Fp8Rows [T, inter] (with its values in
    x's dtype if ``keep_values``)."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_rows, width = x2d.shape
    assert width % 2 == 0, "last dim must be 2 * intermediate size"
    inter = width // 2
    codes = torch.empty((num_rows, inter), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    values = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device) if keep_values else None
    if num_rows and inter:
        # with LoRA 4 columns a thread, not 8 (sm90: 255 registers and spills at 8)
        block = min(2048 if lora is not None else 4096, triton.next_power_of_2(inter))
        num_warps = max(1, min(16, block // 128)) if lora is not None else max(1, min(8, block // 512))
        _silu_mul_fp8_kernel[(num_rows,)](
            x2d, codes, scale, codes if values is None else values, x2d.stride(0), codes.stride(0), inter,
            BLOCK=block, FP8_LIMIT=FP8_MAX, SOFT_ROUND=soft_round(), KEEP_VALUES=keep_values,
            num_warps=num_warps, **_lora_arguments(x2d, lora), **launch_options(x2d),
        )
    elif num_rows:
        scale.fill_(1.0)
    return Fp8Rows(codes, scale, x.dtype, values)
