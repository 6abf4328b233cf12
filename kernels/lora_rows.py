"""A projection's LoRA expand folded into the kernel that reads its output next.

The o and down projections of a decoder layer are followed by the residual add and the next
RMSNorm (one program per row, the whole row in registers). With adapter rows, that kernel adds
each row's LoRA to the projection's output before the add (``LoraRows``; kernels.rms_norm), so a
projection's LoRA costs one launch (the shrink, ``ops.lora_partials``) instead of two, and the
norm stays fused. Each row reads its slot's B ([N, R]: a few hundred KB, from L2) once.
The gate/up projection is followed by SiLU·mul: where its A stacks live under its weight, the
product's extra columns are every slot's gate and up shrinks, and SiLU·mul adds each part's LoRA
to its half before the activation (``gate_up_rows``; kernels.activation), so gate/up's LoRA costs
no launch of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


# The shrink of such a projection splits K up to this many ways (filling the device: no expand
# program reads every split's partials here, only each row its own, in one load of this width)
LORA_MOST_SPLITS = 64


class LoraRows(NamedTuple):
    """What the kernel after a single-part projection needs to add its LoRA (reference.lora_rows_add)."""

    partials: torch.Tensor  # [S, T, R] fp32: the shrink's split-K sums (rows of no adapter are not read)
    b: torch.Tensor  # [L, N, R]: the projection's B in every slot
    scales: torch.Tensor  # [L] fp32: each slot's scaling
    row_slots: torch.Tensor  # [T] int64: each row's slot, -1 for the base model's rows
    # 0: partials are each row's own; a multiple of R: partials is [1, T, ...], every slot's shrink (a
    # fused weight's extra columns, any float dtype), a row of slot s reading columns s * slot_stride ..
    # (R for a single-part projection; parts * R for one part of gate/up, its view starting at its part)
    slot_stride: int = 0


def check(y: torch.Tensor, rows: LoraRows) -> None:
    num_tokens, n = y.shape
    splits, t, rank = rows.partials.shape
    assert t == num_tokens and rows.row_slots.shape == (num_tokens,), "one partial row and one slot per row"
    assert splits <= LORA_MOST_SPLITS
    assert rows.b.shape[1:] == (n, rows.b.shape[2]) and rows.b.stride(2) == 1 and rows.b.stride(1) == rows.b.shape[2]
    if rows.slot_stride:
        assert splits == 1 and rows.slot_stride % rows.b.shape[2] == 0
        assert rank >= (rows.b.shape[0] - 1) * rows.slot_stride + rows.b.shape[2]
    else:
        assert rank == rows.b.shape[2] and rows.partials.dtype == torch.float32
    assert rows.partials.stride(2) == 1
    assert rows.scales.dtype == torch.float32 and rows.scales.shape == rows.b.shape[:1] and rows.scales.stride(0) == 1
    assert rows.row_slots.dtype == torch.int64 and rows.row_slots.is_contiguous()


def gate_up_rows(shrunk: torch.Tensor, b: list[torch.Tensor], scales: torch.Tensor, row_slots: torch.Tensor,
                 rank: int) -> tuple[LoraRows, LoraRows]:
    """A fused gate/up weight's product's extra columns ``shrunk`` [T, L * 2 * rank] (each slot's gate
    shrink, then its up shrink), the parts' B ``b`` ([L, I, rank] each) and ``scales`` [2, L] -> the
    gate's and the up's LoraRows, for the SiLU·mul that reads the projection's output."""
    return tuple(LoraRows(shrunk[:, part * rank:].unsqueeze(0), b[part], scales[part], row_slots,
                          slot_stride=2 * rank) for part in (0, 1))


def split_product(out: torch.Tensor, rows: LoraRows, num_out: int) -> tuple[torch.Tensor, LoraRows]:
    """A fused weight's product [T, num_out + slots * R] -> (the projection's columns, ``rows`` with the
    rest, every slot's shrink, as its partials)."""
    return out[:, :num_out], rows._replace(partials=out[:, num_out:].unsqueeze(0))
