"""The batched LoRA kernels against their torch references: rows of several adapters (slots of
different ranks, zero-padded to the stack's rank) and rows of none in one batch, segments in any
order, an explicit slot -1 segment and an empty one, and outputs that are column slices of a
wider projection output."""

import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, requires_cuda

from tandem.kernels import reference
from tandem.kernels.lora import lora_add, lora_expand, lora_expand_slots, lora_shrink

RANK = 16  # the stacks' (maximum) rank


def _segments(token_slots: list[int], extra: list[tuple[int, list[int]]] = ()):
    """token_order, seg_starts, seg_slots grouping the rows by slot (slots in descending order, so
    the segments are not in slot order); rows of slot -1 in no segment; ``extra`` segments
    (slot, rows) appended as given."""
    groups = [(slot, [t for t, s in enumerate(token_slots) if s == slot])
              for slot in sorted({s for s in token_slots if s >= 0}, reverse=True)]
    groups += list(extra)
    order, starts, slots = [], [0], []
    for slot, rows in groups:
        order += rows
        starts.append(len(order))
        slots.append(slot)
    return (torch.tensor(order, dtype=torch.int64, device=DEVICE),
            torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            torch.tensor(slots, dtype=torch.int32, device=DEVICE))


def _stack(num_slots: int, rows: int, cols: int, ranks: list[int], rank_dim: int, dtype) -> torch.Tensor:
    """[num_slots, rows, cols] random, each slot's entries past its rank zero along ``rank_dim``
    (1: an A stack's rows, 2: a B stack's columns), as the engine's slots hold them."""
    stack = torch.randn(num_slots, rows, cols) / cols**0.5
    for slot, rank in enumerate(ranks):
        if rank_dim == 1:
            stack[slot, rank:] = 0
        else:
            stack[slot, :, rank:] = 0
    return stack.to(DEVICE, dtype)


# one row of slot 2 alone, base rows between adapter rows, a prefill-like run of slot 0
SLOTS = [0, -1, 1, 0, 0, -1, 2, 1, 0, 0, 0, -1]
RANKS = [4, 16, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [64, 100])
def test_shrink_matches_reference(dtype, K):
    x = torch.randn(len(SLOTS), K, device=DEVICE).to(dtype)
    a = _stack(3, RANK, K, RANKS, 1, dtype)
    segments = _segments(SLOTS, extra=[(-1, []), (1, [])])  # a slot -1 segment, an empty one
    got = lora_shrink(x, a, *segments)
    want = reference.lora_shrink(x, a, *segments)
    assert got.dtype == torch.float32 and got.shape == (len(SLOTS), RANK)
    assert_close(got, want, dtype, scale=4)
    base = [t for t, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(got[base], torch.zeros_like(got[base]))


@pytest.mark.parametrize("split_k", [2, 3])
def test_shrink_split_over_k_matches_reference(split_k):
    """K reduced in ranges apart (a decode step's small grid on a GPU), summed in a fixed order."""
    x = torch.randn(len(SLOTS), 200, device=DEVICE)
    a = _stack(3, RANK, 200, RANKS, 1, torch.float32)
    segments = _segments(SLOTS)
    got = lora_shrink(x, a, *segments, split_k=split_k)
    assert got.shape == (len(SLOTS), RANK)
    assert_close(got, reference.lora_shrink(x, a, *segments), torch.float32)
    assert torch.equal(lora_shrink(x, a, *segments, split_k=split_k), got)  # the same sum every time


def test_shrink_with_a_slot_minus_one_segment_holding_rows():
    """Rows in a segment of slot -1 are the base model's: zero, as rows of no segment."""
    x = torch.randn(4, 32, device=DEVICE)
    a = _stack(2, RANK, 32, [8, 8], 1, torch.float32)
    order = torch.tensor([0, 1, 2, 3], device=DEVICE)
    starts = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([-1, 1], dtype=torch.int32, device=DEVICE)
    got = lora_shrink(x, a, order, starts, slots)
    assert torch.equal(got[:2], torch.zeros(2, RANK, device=DEVICE))
    assert_close(got, reference.lora_shrink(x, a, order, starts, slots), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_expand_into_column_slices_of_a_fused_output(dtype):
    """A [q | k | v]-like output: each part's expand writes its own column slice (row stride
    wider than the slice), from its own column slice of the shrink; other columns, and the
    base rows, keep their values exactly."""
    parts = [48, 16, 16]
    out = torch.randn(len(SLOTS), sum(parts), device=DEVICE).to(dtype)
    shrunk = torch.randn(len(SLOTS), 3 * RANK, device=DEVICE)
    segments = _segments(SLOTS, extra=[(-1, [])])
    scales = torch.tensor([2.0, 0.5, 1.25], device=DEVICE)
    want, got = out.clone(), out.clone()
    offset = 0
    for p, width in enumerate(parts):
        b = _stack(3, width, RANK, RANKS, 2, dtype)
        s_part = shrunk[:, p * RANK:(p + 1) * RANK]
        reference.lora_expand(want[:, offset:offset + width], s_part, b, *segments, scales)
        y = got[:, offset:offset + width]
        assert not y.is_contiguous()
        lora_expand(y, s_part, b, *segments, scales)
        offset += width
    assert_close(got, want, dtype)
    base = [t for t, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(got[base], out[base])


def test_expand_leaves_the_other_columns_alone():
    out = torch.randn(5, 96, device=DEVICE)
    before = out.clone()
    b = _stack(1, 32, RANK, [RANK], 2, torch.float32)
    lora_expand(out[:, 40:72], torch.randn(5, RANK, device=DEVICE), b, *_segments([0, 0, -1, 0, 0]),
                torch.ones(1, device=DEVICE))
    assert torch.equal(out[:, :40], before[:, :40]) and torch.equal(out[:, 72:], before[:, 72:])
    assert torch.equal(out[2], before[2])
    assert not torch.equal(out[:, 40:72], before[:, 40:72])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_then_expand_equals_the_per_row_products(dtype):
    """The two ops together: each row gets x @ A_s^T @ B_s^T * scale_s of its own slot (a long
    segment spanning several row tiles), the base rows nothing."""
    slots = [1] * 70 + [-1, 0, -1, 0]
    K, N = 64, 80
    x = torch.randn(len(slots), K, device=DEVICE).to(dtype)
    a = _stack(2, RANK, K, [RANK, 4], 1, dtype)
    b = _stack(2, N, RANK, [RANK, 4], 2, dtype)
    scales = torch.tensor([0.5, 3.0], device=DEVICE)
    segments = _segments(slots)
    y = torch.zeros(len(slots), N, device=DEVICE, dtype=dtype)
    lora_expand(y, lora_shrink(x, a, *segments), b, *segments, scales)
    want = torch.zeros(len(slots), N)
    for t, s in enumerate(slots):
        if s >= 0:
            want[t] = x[t].float().cpu() @ a[s].float().cpu().T @ b[s].float().cpu().T * scales[s].item()
    assert_close(y, want, dtype, scale=4)


def test_no_adapter_rows_is_a_no_op():
    x = torch.randn(3, 32, device=DEVICE)
    empty = _segments([-1, -1, -1])
    assert torch.equal(lora_shrink(x, _stack(2, RANK, 32, [8, 8], 1, torch.float32), *empty),
                       torch.zeros(3, RANK, device=DEVICE))
    y = torch.randn(3, 16, device=DEVICE)
    before = y.clone()
    lora_expand(y, torch.randn(3, RANK, device=DEVICE), _stack(2, 16, RANK, [8, 8], 2, torch.float32), *empty,
                torch.ones(2, device=DEVICE))
    assert torch.equal(y, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts, split_k", [([48, 16, 16], 1), ([48, 16, 16], 3), ([40, 24], 2), ([72], 4)])
def test_add_of_a_fused_projection_matches_reference(dtype, parts, split_k):
    """The whole projection in two launches (shrink into split-K partials with no fill, one expand
    over every part, part bounds inside a column tile too) equals the reference's shrink and
    per-part expands; the base rows keep their values exactly."""
    K = 96
    x = torch.randn(len(SLOTS), K, device=DEVICE).to(dtype)
    a = _stack(3, len(parts) * RANK, K, [RANK * len(parts)] * 3, 1, dtype)
    for slot, rank in enumerate(RANKS):  # each part's A zero past the slot's rank
        for p in range(len(parts)):
            a[slot, p * RANK + rank:(p + 1) * RANK] = 0
    b = _stack(3, sum(parts), RANK, RANKS, 2, dtype)
    scales = torch.rand(len(parts), 3, device=DEVICE) + 0.5
    offsets = [sum(parts[:p]) for p in range(len(parts))]
    segments = _segments(SLOTS, extra=[(-1, [1]), (1, [])])
    out = torch.randn(len(SLOTS), sum(parts), device=DEVICE).to(dtype)
    want, got = out.clone(), out.clone()
    reference.lora_add(want, x, a, b, offsets, scales, *segments)
    lora_add(got, x, a, b, offsets, scales, *segments, split_k=split_k)
    assert_close(got, want, dtype, scale=4)
    base = [t for t, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(got[base], out[base])
    assert not torch.equal(got, out)


def test_add_reference_is_shrink_then_each_parts_expand():
    """reference.lora_add is the two ops of the contract, part by part."""
    parts, K = [32, 16], 40
    x = torch.randn(len(SLOTS), K, device=DEVICE)
    a = _stack(3, 2 * RANK, K, [2 * RANK] * 3, 1, torch.float32)
    b = _stack(3, sum(parts), RANK, [RANK] * 3, 2, torch.float32)
    scales = torch.rand(2, 3, device=DEVICE)
    segments = _segments(SLOTS)
    got = torch.zeros(len(SLOTS), sum(parts), device=DEVICE)
    reference.lora_add(got, x, a, b, [0, 32], scales, *segments)
    want = torch.zeros_like(got)
    for t, s in enumerate(SLOTS):
        if s >= 0:
            for p, (lo, hi) in enumerate([(0, 32), (32, 48)]):
                want[t, lo:hi] = x[t] @ a[s, p * RANK:(p + 1) * RANK].T @ b[s, lo:hi].T * scales[p, s]
    assert_close(got, want, torch.float32)


@gpu
@requires_cuda
@pytest.mark.parametrize("rows_per_adapter, num_adapters", [(8, 8), (1, 1), (512, 4)])
def test_gpu_llama3_8b_qkv_add_bf16(rows_per_adapter, num_adapters):
    """``lora_add`` over llama3-8b's fused q/k/v at rank 16 in 8 slots against the reference."""
    K, parts, dtype = 4096, [4096, 1024, 1024], torch.bfloat16
    slots = [s for _ in range(rows_per_adapter) for s in range(num_adapters)] + [-1] * 7
    slots = [slots[i] for i in torch.randperm(len(slots)).tolist()]
    segments = _segments(slots)
    x = torch.randn(len(slots), K, device="cuda").to(dtype)
    a = _stack(8, 3 * RANK, K, [3 * RANK] * 8, 1, dtype)
    b = _stack(8, sum(parts), RANK, [RANK] * 8, 2, dtype)
    scales = torch.rand(3, 8, device="cuda") + 0.5
    out = torch.randn(len(slots), sum(parts), device="cuda").to(dtype)
    want = out.clone()
    lora_add(out, x, a, b, [0, 4096, 5120], scales, *segments)
    reference.lora_add(want, x, a, b, [0, 4096, 5120], scales, *segments)
    assert_close(out, want, dtype, scale=4)


@gpu
@requires_cuda
@pytest.mark.parametrize("rows_per_adapter, num_adapters", [(8, 8), (1, 1), (512, 4)])
def test_gpu_llama3_8b_qkv_bf16(rows_per_adapter, num_adapters):
    """llama3-8b's fused q/k/v (4096 -> 4096 + 1024 + 1024), rank 16 in 8 slots: a decode batch of 64
    rows over 8 adapters, one adapter row among base rows, and 2048 prompt rows over 4 adapters,
    interleaved with base rows."""
    K, parts, dtype = 4096, [4096, 1024, 1024], torch.bfloat16
    slots = [s for _ in range(rows_per_adapter) for s in range(num_adapters)] + [-1] * 7
    order = torch.randperm(len(slots)).tolist()
    slots = [slots[i] for i in order]
    segments = _segments(slots)
    x = torch.randn(len(slots), K, device="cuda").to(dtype)
    a = _stack(8, 3 * RANK, K, [3 * RANK] * 8, 1, dtype)
    shrunk = lora_shrink(x, a, *segments)
    assert_close(shrunk, reference.lora_shrink(x, a, *segments), dtype, scale=4)
    out = torch.randn(len(slots), sum(parts), device="cuda").to(dtype)
    want, offset = out.clone(), 0
    scales = torch.rand(8, device="cuda") + 0.5
    for p, width in enumerate(parts):
        b = _stack(8, width, RANK, [RANK] * 8, 2, dtype)
        s_part = shrunk[:, p * RANK:(p + 1) * RANK]
        lora_expand(out[:, offset:offset + width], s_part, b, *segments, scales)
        reference.lora_expand(want[:, offset:offset + width], s_part, b, *segments, scales)
        offset += width
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 3])
def test_expand_from_every_slots_shrink_matches_reference(dtype, parts):
    """lora_expand_slots: the expand of lora_add from a fused weight's extra columns, [T, L * P * R]
    in the activations' dtype, a row of slot s reading columns s * P * R onward (others ignored)."""
    n, slots = 48 * parts, 3
    offsets = [0, 48, 96][:parts]
    shrunk = torch.randn(len(SLOTS), slots * parts * RANK, device=DEVICE).to(dtype)
    b = _stack(slots, n, RANK, RANKS, 2, dtype)
    scales = torch.rand(parts, slots, device=DEVICE) + 0.5
    segments = _segments(SLOTS)
    y = torch.randn(len(SLOTS), n, device=DEVICE).to(dtype)
    got, want = y.clone(), y.clone()
    lora_expand_slots(got, shrunk, b, offsets, scales, *segments)
    reference.lora_expand_slots(want, shrunk, b, offsets, scales, *segments)
    assert_close(got, want, dtype, scale=4)
    base = [t for t, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])


def test_row_tiles_follow_the_average_segment():
    """The row tile is the rows an average segment holds (16 for 48 rows over 3 segments), so a
    segment longer than that spans several tiles (40 rows: 3) and still matches the reference."""
    from tandem.kernels.lora import _segment_rows_block

    assert [_segment_rows_block(64, 8), _segment_rows_block(64, 1), _segment_rows_block(48, 3),
            _segment_rows_block(2048, 2), _segment_rows_block(5, 0)] == [16, 64, 16, 64, 16]
    slots = [0] * 40 + [1] * 4 + [2] * 4
    K, N = 64, 48
    x = torch.randn(len(slots), K, device=DEVICE)
    a = _stack(3, RANK, K, RANKS, 1, torch.float32)
    b = _stack(3, N, RANK, RANKS, 2, torch.float32)
    scales = torch.rand(1, 3, device=DEVICE) + 0.5
    segments = _segments(slots)
    out = torch.randn(len(slots), N, device=DEVICE)
    want, got = out.clone(), out.clone()
    reference.lora_add(want, x, a, b, [0], scales, *segments)
    lora_add(got, x, a, b, [0], scales, *segments)
    assert_close(got, want, torch.float32, scale=4)
