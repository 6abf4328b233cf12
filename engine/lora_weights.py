"""The adapters' weights on the device: ``max_loras`` slots, stacked per decoder projection.

The model holds q/k/v fused as ``qkv_proj`` and gate/up as ``gate_up_proj`` (engine.loader), so
one projection has one to three LoRA targets (its parts). Per layer and projection:

    a       [max_loras, parts * max_rank, in_features]  each part's A, zero rows past its rank
    b_all   [max_loras, out_features, max_rank]         every part's B, one after another along
                                                        the fused output's columns, zero columns
                                                        past a slot's rank
    b[p]    [max_loras, out_p, max_rank]                part p's rows of b_all (a view)
    scales  [parts, max_loras] fp32                     part p's scaling in each slot

Fused (``fuse_into``): a projection's ``a`` lives under the model's weight rows, in one tensor
``weight`` [out_features + max_loras * parts * max_rank, in_features] whose first rows are the
projection's own (the module's weight is their view), so a step with adapter rows computes the
projection and every slot's shrink in one matmul (``engine.lora_batch``), where the shrink is a
launch of its own otherwise. It is done where the extra rows are at most ``FUSE_MOST_EXTRA`` of
the weight's: they are read by every such step. An FP8 projection (``Fp8Weight``: E4M3 rows, a
scale per row) takes its A rows quantized the same way, a scale per row (``quantize_rows``), in
its data and scales; ``a`` stays apart in the model's dtype, and writing a slot quantizes that
slot's rows into the fused weight (the shrink then multiplies E4M3 codes, as the projection does).

Part p's rows of ``lora_shrink``'s output are columns p * max_rank .. (p + 1) * max_rank, and its
``lora_expand`` adds into the projection output's columns ``offsets[p]`` .. + out_p (q, k, v's
slices of the fused output). A part the adapter does not target is zero (A, B and scale): it
adds nothing. Writing a slot copies an adapter's tensors into that slot's entries (cast to the
model's dtype) and zeroes the rest of them; no other slot is written.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.lora_adapter import LoraAdapter, target_shapes
from tandem.kernels.fp8_weight import Fp8Weight, quantize_rows

# fuse_into puts a projection's A stacks under its weight where they add at most this share of its rows
FUSE_MOST_EXTRA = 1 / 16

# the model's projection -> its LoRA targets, in the order the loader fuses them
PROJECTION_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
TARGET_PROJECTION = {t: proj for proj, targets in PROJECTION_TARGETS.items() for t in targets}


@dataclass
class ProjectionLora:
    """One layer's projection: its slots' stacked weights (module docstring)."""

    a: torch.Tensor
    b_all: torch.Tensor
    b: list[torch.Tensor]  # views of b_all
    scales: torch.Tensor
    offsets: list[int]  # each part's first column in the projection's output
    rank: int  # the stacks' (maximum) rank
    # fused: the model's weight rows, then ``a``'s (in the model's dtype ``a`` is a view of them; an
    # Fp8Weight holds their E4M3 codes and scales)
    weight: torch.Tensor | Fp8Weight | None = None
    bias: torch.Tensor | None = None  # fused with a bias: the model's, then zeros for ``a``'s rows


class LoraWeights:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_rank ({max_rank}) must be positive")
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        shapes = target_shapes(config)
        self.layers: list[dict[str, ProjectionLora]] = []
        for _ in range(config.num_layers):
            layer = {}
            for proj, targets in PROJECTION_TARGETS.items():
                in_features = shapes[targets[0]][0]
                outs = [shapes[t][1] for t in targets]
                offsets = [sum(outs[:p]) for p in range(len(outs))]
                b_all = torch.zeros(max_loras, sum(outs), max_rank, dtype=dtype, device=self.device)
                layer[proj] = ProjectionLora(
                    a=torch.zeros(max_loras, len(targets) * max_rank, in_features, dtype=dtype, device=self.device),
                    b_all=b_all,
                    b=[b_all[:, offset:offset + out] for offset, out in zip(offsets, outs)],
                    scales=torch.zeros(len(targets), max_loras, dtype=torch.float32, device=self.device),
                    offsets=offsets,
                    rank=max_rank,
                )
            self.layers.append(layer)
        # what each slot holds: the projections its adapter targets (empty: nothing)
        self._projections: list[frozenset[str]] = [frozenset()] * max_loras

    def projections(self, slot: int) -> frozenset[str]:
        """The model projections slot ``slot``'s adapter adds to (empty for an empty slot)."""
        return self._projections[slot]

    def occupied(self, slot: int) -> bool:
        return bool(self._projections[slot])

    @contextmanager
    def zero_adapter(self, slot: int, targets=PROJECTION_TARGETS):
        """Within: the empty slot ``slot`` holds an adapter of ``targets`` (every projection) whose
        weights and scales are all zero, so a step of its rows launches those projections' LoRA
        kernels and adds nothing (the warm-up's, ``engine.warmup.warm_up_adapters``)."""
        if self.occupied(slot):
            raise ValueError(f"LoRA slot {slot} holds an adapter")
        self._projections[slot] = frozenset(targets)
        try:
            yield
        finally:
            self._projections[slot] = frozenset()

    def fuse_into(self, model, force: bool | None = None) -> int:
        """Put each projection's A stacks under ``model``'s weight of it (module docstring), where
        its weight is whole (not a tensor-parallel shard) in the model's dtype or FP8 (then with a
        multiple of 16 rows of stacks), and the stacks add at most ``FUSE_MOST_EXTRA`` of its rows (``force``: True everywhere it can, False
        nowhere) -> the projections fused. Before CUDA graphs capture the model."""
        fused_count = 0
        for layer, stacks in zip(model.layers, self.layers):
            for proj, stack in stacks.items():
                module = getattr(layer, proj)
                weight, (slots, rows, in_features) = module.weight, stack.a.shape
                extra, fp8 = slots * rows, getattr(module, "weight_scale", None) is not None
                # an FP8 weight's rows stay a multiple of 16 (torch's scaled matmul takes no others), so
                # the fused weight takes the routes the model's own does (ops.quantizes_input)
                if (stack.weight is not None or (not fp8 and weight.dtype != stack.a.dtype)
                        or (fp8 and extra % 16) or weight.shape[1] != in_features or force is False
                        or (force is None and extra > weight.shape[0] * FUSE_MOST_EXTRA)):
                    continue
                n = weight.shape[0]
                fused = torch.empty(n + extra, in_features, dtype=weight.dtype, device=weight.device)
                fused[:n].copy_(weight)
                module.weight = torch.nn.Parameter(fused[:n], requires_grad=False)
                if fp8:
                    scale = torch.empty(n + extra, dtype=torch.float32, device=weight.device)
                    scale[:n].copy_(module.weight_scale)
                    module.weight_scale = scale[:n]
                    fused[n:], scale[n:] = quantize_rows(stack.a.reshape(extra, in_features))
                    stack.weight = Fp8Weight(fused, scale)
                else:
                    fused[n:].copy_(stack.a.reshape(extra, in_features))
                    stack.a, stack.weight = fused[n:].view(slots, rows, in_features), fused
                if module.bias is not None:
                    stack.bias = torch.cat([module.bias.detach(), module.bias.new_zeros(extra)])
                    module.bias = torch.nn.Parameter(stack.bias[:n], requires_grad=False)
                fused_count += 1
        return fused_count

    def sync_fused(self, slot: int) -> None:
        """Slot ``slot``'s rows of every FP8 fused weight (its A's E4M3 codes and their scales) from its
        ``a`` (``write`` and ``clear`` do it; a caller that writes ``a`` in place calls it after)."""
        for layer in self.layers:
            for stack in layer.values():
                if isinstance(stack.weight, Fp8Weight):
                    slots, rows, _ = stack.a.shape
                    first = stack.weight.shape[0] - (slots - slot) * rows
                    codes, scales = quantize_rows(stack.a[slot])
                    stack.weight.data[first:first + rows].copy_(codes)
                    stack.weight.scale[first:first + rows].copy_(scales)

    def nbytes(self) -> int:
        """Device bytes of the slots: every stack, and an FP8 fused weight's rows of them."""
        total = sum(t.nbytes for layer in self.layers for p in layer.values() for t in (p.a, p.b_all, p.scales))
        for layer in self.layers:
            for p in layer.values():
                if isinstance(p.weight, Fp8Weight):
                    extra = p.a.shape[0] * p.a.shape[1]
                    total += extra * (p.weight.data.shape[1] * p.weight.data.element_size() + 4)
        return total

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into slot ``slot`` (everything of the slot it does not fill is zeroed). On a
        GPU the copies queue on the current stream behind the steps already launched there, so a
        step still running (run-ahead) reads the slot's previous adapter to its end."""
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(f"an adapter of rank {adapter.rank} in slots of rank {self.max_rank}")
        self._zero(slot)
        for (layer_idx, target), module in adapter.modules.items():
            proj = TARGET_PROJECTION[target]
            stack = self.layers[layer_idx][proj]
            part = PROJECTION_TARGETS[proj].index(target)
            r, first = module.rank, part * self.max_rank
            stack.a[slot, first:first + r].copy_(module.a)
            stack.b[part][slot, :, :r].copy_(module.b)
            stack.scales[part, slot] = module.scaling
        self.sync_fused(slot)
        self._projections[slot] = frozenset(TARGET_PROJECTION[t] for t in adapter.targets)

    def clear(self, slot: int) -> None:
        """Zero slot ``slot``'s entries: it adds nothing and holds nothing."""
        self._check_slot(slot)
        self._zero(slot)
        self.sync_fused(slot)

    def _zero(self, slot: int) -> None:
        for layer in self.layers:
            for stack in layer.values():
                stack.a[slot].zero_()
                stack.b_all[slot].zero_()
                stack.scales[:, slot] = 0.0
        self._projections[slot] = frozenset()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of range 0..{self.max_loras - 1}")
