"""A single-part projection's LoRA expand folded into the add-norm after it (kernels.lora_rows,
kernels.rms_norm with ``lora``): the same as the expand kernel's output normed, for rows of
several adapters and of none, shrink partials over several splits, in the model's dtype and in
the FP8 form the next projection takes; the torch reference equals reference.lora_expand's."""

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close
from test_lora import RANK, RANKS, SLOTS, _segments, _stack

from tandem.kernels import reference
from tandem.kernels.lora import _shrink, lora_expand
from tandem.kernels.lora_rows import LoraRows
from tandem.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_fp8

HIDDEN, K = 96, 200


def _rows(dtype, split: int, k: int = K):
    """x (a projection's output), its input, the LoRA of 3 slots and the LoraRows of its shrink."""
    inputs = torch.randn(len(SLOTS), k, device=DEVICE).to(dtype)
    a = _stack(3, RANK, k, RANKS, 1, dtype)
    b = _stack(3, HIDDEN, RANK, RANKS, 2, dtype)
    scales = torch.tensor([0.5, 2.0, 1.25], device=DEVICE)
    segments = _segments(SLOTS)
    partials = _shrink(inputs, a, segments, split, torch.zeros)
    assert partials.shape[0] == split
    row_slots = torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE)
    return segments, LoraRows(partials, b, scales, row_slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split, k", [(1, K), (3, K), (64, 64 * 64)])  # 64: LORA_MOST_SPLITS
def test_the_norm_adds_each_rows_lora_as_the_expand_kernel_does(dtype, split, k):
    segments, rows = _rows(dtype, split, k)
    x = torch.randn(len(SLOTS), HIDDEN, device=DEVICE).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.rand(HIDDEN, device=DEVICE).to(dtype) + 0.5
    expanded = x.clone()
    lora_expand(expanded, rows.partials.sum(0), rows.b, *segments, rows.scales)
    want_normed, want_h = fused_add_rms_norm(expanded, residual, weight, 1e-5)
    normed, h = fused_add_rms_norm(x, residual, weight, 1e-5, lora=rows)
    # the rows' LoRA sums run in another order than the expand kernel's dot: a value may round one ulp apart
    assert_close(h, want_h, dtype)
    assert_close(normed, want_normed, dtype)
    base = [t for t, s in enumerate(SLOTS) if s < 0]
    plain_normed, plain_h = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(h[base], plain_h[base]) and torch.equal(normed[base], plain_normed[base])  # no adapter
    ref_normed, ref_h = reference.fused_add_rms_norm(x, residual, weight, 1e-5, lora=rows)
    assert_close(h, ref_h, dtype)
    assert_close(normed, ref_normed, dtype)


def test_the_fp8_form_keeps_the_lora_rows_values():
    segments, rows = _rows(torch.bfloat16, 2)
    x = torch.randn(len(SLOTS), HIDDEN, device=DEVICE).to(torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(HIDDEN, device=DEVICE).to(torch.bfloat16) + 0.5
    normed, h = fused_add_rms_norm(x, residual, weight, 1e-5, lora=rows)
    fp8, h_fp8 = fused_add_rms_norm_fp8(x, residual, weight, 1e-5, keep_values=True, lora=rows)
    assert torch.equal(h_fp8, h) and torch.equal(fp8.values, normed)  # the same kernel math, quantized after


def test_the_reference_is_lora_expand_then_the_norm():
    segments, rows = _rows(torch.float32, 1)
    y = torch.randn(len(SLOTS), HIDDEN, device=DEVICE)
    want = y.clone()
    reference.lora_expand(want, rows.partials.sum(0), rows.b, *segments, rows.scales)
    assert torch.equal(reference.lora_rows_add(y, rows), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_slots_shrink_from_a_fused_weight(dtype):
    """slot_stride: partials [1, T, L * R] in the activations' dtype (a fused weight's extra
    columns), a row of slot s reading columns s * R onward: as the reference."""
    slots = 3
    shrunk = torch.randn(1, len(SLOTS), slots * RANK, device=DEVICE).to(dtype)
    b = _stack(slots, HIDDEN, RANK, RANKS, 2, dtype)
    rows = LoraRows(shrunk, b, torch.tensor([0.5, 2.0, 1.25], device=DEVICE),
                    torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE), slot_stride=RANK)
    x = torch.randn(len(SLOTS), HIDDEN, device=DEVICE).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.rand(HIDDEN, device=DEVICE).to(dtype) + 0.5
    normed, h = fused_add_rms_norm(x, residual, weight, 1e-5, lora=rows)
    ref_normed, ref_h = reference.fused_add_rms_norm(x, residual, weight, 1e-5, lora=rows)
    assert_close(h, ref_h, dtype)
    assert_close(normed, ref_normed, dtype)
    own = LoraRows(torch.stack([shrunk[0, t, s * RANK:(s + 1) * RANK] if s >= 0 else torch.zeros(RANK, dtype=dtype)
                                for t, s in enumerate(SLOTS)])[None].float(), b, rows.scales, rows.row_slots)
    assert torch.equal(reference.lora_rows_add(x, own), reference.lora_rows_add(x, rows))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_silu_mul_adds_gate_and_ups_lora_as_the_expand_kernel_does(dtype, fp8):
    """gate/up's LoRA in the SiLU·mul after it (lora_rows.gate_up_rows: a fused weight's extra columns,
    each slot's gate then up shrink): the same as lora_expand_slots into the projection's output, then
    SiLU·mul, within a value's rounding (the rows' sums run in another order than the expand's dot); the
    FP8 form quantizes that; rows of no adapter are the plain kernel's, bit for bit."""
    from tandem.kernels.activation import silu_mul, silu_mul_fp8
    from tandem.kernels.lora import lora_expand_slots
    from tandem.kernels.lora_rows import gate_up_rows

    if fp8 and dtype == torch.float32:
        pytest.skip("the FP8 form follows a 16-bit projection")
    inter, slots = 80, 3
    b_all = torch.cat([_stack(slots, inter, RANK, RANKS, 2, dtype), _stack(slots, inter, RANK, RANKS, 2, dtype)], 1)
    b = [b_all[:, :inter], b_all[:, inter:]]
    scales = torch.tensor([[0.5, 2.0, 1.25], [1.5, 0.25, 1.0]], device=DEVICE)
    gate_up = torch.randn(len(SLOTS), 2 * inter, device=DEVICE).to(dtype)
    shrunk = torch.randn(len(SLOTS), slots * 2 * RANK, device=DEVICE).to(dtype)
    row_slots = torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE)
    rows = gate_up_rows(shrunk, b, scales, row_slots, RANK)
    expanded = gate_up.clone()
    lora_expand_slots(expanded, shrunk, b_all, [0, inter], scales, *_segments(SLOTS))
    base = [t for t, s in enumerate(SLOTS) if s < 0]
    if fp8:
        out = silu_mul_fp8(gate_up, keep_values=True, lora=rows)
        want = silu_mul_fp8(expanded, keep_values=True)
        plain = silu_mul_fp8(gate_up, keep_values=True)
        assert_close(out.values, want.values, dtype)
        assert torch.equal(out.codes[base], plain.codes[base]) and torch.equal(out.scale[base], plain.scale[base])
        ref = reference.silu_mul_fp8(gate_up, keep_values=True, lora=rows)
        assert_close(out.values, ref.values, dtype)
        assert_close(out.codes.float() * out.scale, ref.codes.float() * ref.scale, dtype, scale=8)
    else:
        out = silu_mul(gate_up, lora=rows)
        assert_close(out, silu_mul(expanded), dtype)
        assert torch.equal(out[base], silu_mul(gate_up)[base])
        assert_close(out, reference.silu_mul(gate_up, lora=rows), dtype)
    assert not torch.equal((out.values if fp8 else out)[0], (plain.values if fp8 else silu_mul(gate_up))[0])
