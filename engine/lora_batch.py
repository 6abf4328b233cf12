"""One step's LoRA: which rows carry which adapter slot, and the projections' LoRA applied to them.

A step's rows (decode rows and prompt chunks' tokens alike) may carry different adapters and
none. ``build_lora_batch`` groups the rows that carry one into a segment per slot, the form
the LoRA op takes (``kernels.ops.lora_add``): ``token_order`` lists those rows slot by
slot, ``seg_starts`` where each slot's run begins, ``seg_slots`` its slot; ``row_slots`` gives
every row's slot (-1: none) for the kernels that add a projection's LoRA row by row
(``kernels.lora_rows``: the o and down projections', in the add-norm after them, and gate/up's in
the SiLU·mul after it). A step without
adapter rows has no ``LoraBatch`` (``AttentionMetadata.lora`` is None) and its forward is the
base model's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.device_copy import tensor_on
from tandem.engine.lora_weights import LoraWeights
from tandem.kernels import ops
from tandem.kernels.fp8_weight import in_model_dtype
from tandem.kernels.lora_rows import LoraRows, gate_up_rows


@dataclass
class LoraBatch:
    token_order: torch.Tensor  # [A] int64: the rows with an adapter, grouped by slot
    seg_starts: torch.Tensor  # [S + 1] int32
    seg_slots: torch.Tensor  # [S] int32
    weights: LoraWeights  # the device slots the segments name
    projections: frozenset[str]  # the projections some row's adapter targets; the others are skipped
    row_slots: torch.Tensor  # [T] int64: each row's slot, -1 for the base model's rows

    def needs_values(self, projection: str, layer_idx: int) -> bool:
        """Whether ``projection``'s LoRA in layer ``layer_idx`` reads its input in the model's dtype
        this step (its A stacks apart from its weight): a kernel quantizing that input then keeps its
        values too (``fp8_weight.in_model_dtype``)."""
        return (projection in self.projections and layer_idx < len(self.weights.layers)
                and self.weights.layers[layer_idx][projection].weight is None)

    def linear(self, projection: str, layer_idx: int, x, weight, bias=None) -> torch.Tensor:
        """``projection``'s output for x (ops.linear with its ``weight``) with each adapter row's LoRA of
        it added (every part of a fused projection in its columns). Where its A stacks live under its
        weight (``LoraWeights.fuse_into``) one matmul gives the output and every slot's shrink, and the
        output is a view of its first columns; else the shrink reads x in the model's dtype."""
        if projection not in self.projections:
            return ops.linear(x, weight, bias)
        stack = self.weights.layers[layer_idx][projection]
        segments = (self.token_order, self.seg_starts, self.seg_slots)
        if stack.weight is None:
            out = ops.linear(x, weight, bias)
            ops.lora_add(out, in_model_dtype(x), stack.a, stack.b_all, stack.offsets, stack.scales, *segments)
            return out
        fused = ops.linear(x, stack.weight, None if bias is None else stack.bias)
        out, shrunk = fused[:, : weight.shape[0]], fused[:, weight.shape[0]:]
        ops.lora_expand_slots(out, shrunk, stack.b_all, stack.offsets, stack.scales, *segments)
        return out

    def gate_up_silu_mul(self, layer_idx: int, x, weight, quantize_for=None, keep_values: bool = True):
        """silu(gate) * up of the gate/up projection of x with each adapter row's LoRA added to both
        halves. Its A stacks under its weight (``LoraWeights.fuse_into``): one matmul gives the
        projection and every slot's shrink, and SiLU·mul adds the LoRA (``lora_rows.gate_up_rows``);
        apart: ``linear``, then SiLU·mul. No row's adapter targets it: the base model's
        ``ops.gate_up_silu_mul`` (unless the rows must keep their values). ``quantize_for``,
        ``keep_values``: SiLU·mul's (``ops.silu_mul``), for the down projection after it."""
        if "gate_up_proj" not in self.projections and not keep_values:
            return ops.gate_up_silu_mul(x, weight, quantize_for=quantize_for)
        stack = self.weights.layers[layer_idx]["gate_up_proj"]
        if "gate_up_proj" not in self.projections or stack.weight is None:
            return ops.silu_mul(self.linear("gate_up_proj", layer_idx, x, weight), quantize_for, keep_values)
        fused = ops.linear(x, stack.weight)
        n = weight.shape[0]
        rows = gate_up_rows(fused[:, n:], stack.b, stack.scales, self.row_slots[: fused.shape[0]], stack.rank)
        return ops.silu_mul(fused[:, :n], quantize_for, keep_values, lora=rows)

    def linear_add_rms_norm(self, projection: str, layer_idx: int, x, weight, residual: torch.Tensor,
                            norm_weight: torch.Tensor, eps: float, quantize_for=None, keep_values: bool = True):
        """``projection`` (o or down: single-part) of x, its adapter rows' LoRA, the residual add and the
        next norm -> (normed, new residual), the LoRA added row by row before the add (kernels.lora_rows).
        Fused (``LoraWeights.fuse_into``): as the base model's ops.linear_add_rms_norm, the shrink in its
        extra rows; else the projection, the shrink of x in the model's dtype alone, and the norm adding
        the LoRA. No row's adapter targets it: the projection, then the norm. ``keep_values``: normed
        rows quantized for ``quantize_for`` keep their values (the next projection's LoRA reads them,
        ``needs_values``)."""
        stack = self.weights.layers[layer_idx][projection]
        row_slots = self.row_slots[: x.shape[0]]
        if projection in self.projections and stack.weight is not None:
            rows = LoraRows(None, stack.b_all, stack.scales[0], row_slots, slot_stride=stack.rank)
            return ops.linear_add_rms_norm(x, stack.weight, residual, norm_weight, eps, quantize_for, lora=rows,
                                           keep_values=keep_values)
        rows = None
        if projection in self.projections:
            partials = ops.lora_partials(in_model_dtype(x), stack.a, self.token_order, self.seg_starts,
                                         self.seg_slots)
            rows = LoraRows(partials, stack.b_all, stack.scales[0], row_slots)
        return ops.fused_add_rms_norm(ops.linear(x, weight), residual, norm_weight, eps, quantize_for=quantize_for,
                                      keep_values=keep_values, lora=rows)


def rows_by_slot(chunk_slots: list[tuple[int, int]], weights: LoraWeights) -> dict[int, list[int]]:
    """``chunk_slots`` as ``build_lora_batch`` takes them -> each slot a row names: its rows, slots
    in the order the step first names them. Every slot named must hold an adapter."""
    rows_of: dict[int, list[int]] = {}
    row = 0
    for slot, num_tokens in chunk_slots:
        if slot >= 0:
            if slot >= weights.max_loras or not weights.occupied(slot):
                raise ValueError(f"LoRA slot {slot} holds no adapter")
            rows_of.setdefault(slot, []).extend(range(row, row + num_tokens))
        row += num_tokens
    return rows_of


def build_lora_batch(chunk_slots: list[tuple[int, int]], weights: LoraWeights | None,
                     device: torch.device | str) -> LoraBatch | None:
    """``chunk_slots``: (slot, number of new tokens) of each chunk of a step, in the step's order
    (slot -1: the base model) -> the step's LoraBatch, or None when no row carries an adapter.
    Every slot named must hold an adapter."""
    if all(slot < 0 for slot, _ in chunk_slots):
        return None
    if weights is None:
        raise ValueError("a chunk carries a LoRA slot but the runner has no LoRA slots (enable_lora)")
    rows_of = rows_by_slot(chunk_slots, weights)
    order, starts = [], [0]
    row_slots = [-1] * sum(num_tokens for _, num_tokens in chunk_slots)
    for slot, rows in rows_of.items():
        order.extend(rows)
        starts.append(len(order))
        for row in rows:
            row_slots[row] = slot
    projections = frozenset().union(*(weights.projections(slot) for slot in rows_of))
    return LoraBatch(
        token_order=tensor_on(order, device),
        seg_starts=tensor_on(starts, device, torch.int32),
        seg_slots=tensor_on(list(rows_of), device, torch.int32),
        weights=weights,
        projections=projections,
        row_slots=tensor_on(row_slots, device),
    )
