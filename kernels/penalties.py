"""The repetition, frequency and presence penalties of a batch's penalized rows (Triton).

One program per (penalized row, vocabulary tile) reads the row's logits, its slot's counts
and prompt marks once and writes the penalized logits in place: one pass over the rows
instead of the dozen tensors the torch form (``reference.apply_penalties``) makes, which
at a 128k vocabulary and 64 rows each move 32 MB. The division is IEEE round-to-nearest
(``div_rn``), as torch's, and no multiply-add is fused, so the values are the reference's
(and HF's) bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries per program
# no fused multiply-add (fp fusion off): the reference's values, which are torch's
LAUNCH_OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}


# rows and slots are the two rows of one [2, n] tensor: where slots starts moves with n, and each
# is read one entry a program, so its alignment is no reason for a binary of its own
@triton.jit(do_not_specialize_on_alignment=["rows_ptr", "slots_ptr"])
def _penalties_kernel(
    logits_ptr, stride_logits, rows_ptr, slots_ptr, counts_ptr, stride_counts, prompt_ptr, stride_prompt,
    params_ptr, vocab, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    repetition = tl.load(params_ptr + i * 3)
    frequency = tl.load(params_ptr + i * 3 + 1)
    presence = tl.load(params_ptr + i * 3 + 2)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=mask, other=0.0)
    count = tl.load(counts_ptr + slot * stride_counts + cols, mask=mask, other=0.0)
    in_prompt = tl.load(prompt_ptr + slot * stride_prompt + cols, mask=mask, other=0)
    in_output = count > 0
    repeated = tl.where(x < 0, x * repetition, tl.math.div_rn(x, repetition))
    x = tl.where((in_prompt != 0) | in_output, repeated, x)
    x = x - (frequency * count + presence * in_output.to(tl.float32))
    tl.store(logits_ptr + row * stride_logits + cols, x, mask=mask)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    prompt: torch.Tensor, params: torch.Tensor) -> None:
    """As ``reference.apply_penalties`` (in place on ``logits``)."""
    num_rows, vocab = rows.shape[0], logits.shape[1]
    if num_rows == 0 or vocab == 0:
        return
    assert logits.dtype == counts.dtype == params.dtype == torch.float32 and prompt.dtype == torch.bool
    assert logits.stride(1) == 1 and counts.stride(1) == 1 and prompt.stride(1) == 1
    assert rows.is_contiguous() and slots.is_contiguous() and params.is_contiguous()
    assert counts.shape[1] == prompt.shape[1] == vocab
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    _penalties_kernel[grid](
        logits, logits.stride(0), rows, slots, counts, counts.stride(0), prompt.view(torch.uint8), prompt.stride(0),
        params, vocab, BLOCK=BLOCK, **LAUNCH_OPTIONS,
    )
