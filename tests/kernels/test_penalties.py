import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_testing import DEVICE, assert_close, gpu, requires_cuda

from tandem.kernels import reference
from tandem.kernels.penalties import BLOCK, apply_penalties


def _inputs(batch, vocab, capacity, rows, device=DEVICE):
    logits = torch.randn(batch, vocab) * 4
    logits[0, :7] = float("-inf")  # a structured-output mask before the penalties
    logits[:, 3] = 0.0
    counts = torch.randint(0, 4, (capacity, vocab)).float() * (torch.rand(capacity, vocab) < 0.2)
    prompt = torch.rand(capacity, vocab) < 0.1
    slots = torch.randperm(capacity)[: len(rows)]
    params = torch.stack([torch.rand(len(rows)) * 2 + 0.3, torch.randn(len(rows)), torch.randn(len(rows))], dim=1)
    return [t.to(device) for t in (logits, torch.tensor(rows), slots, counts, prompt, params.contiguous())]


@pytest.mark.parametrize("batch, vocab, rows", [(4, 50, [0, 2, 3]), (3, 2 * BLOCK + 77, [2, 0]), (1, 130, [0])])
def test_matches_reference(batch, vocab, rows):
    logits, rows, slots, counts, prompt, params = _inputs(batch, vocab, 6, rows)
    want = logits.clone()
    reference.apply_penalties(want, rows, slots, counts, prompt, params)
    got = logits.clone()
    apply_penalties(got, rows, slots, counts, prompt, params)
    assert_close(got, want, torch.float32)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    untouched = [r for r in range(batch) if r not in rows.tolist()]
    assert torch.equal(got[untouched], logits[untouched])


def test_the_repetition_rule_is_bit_exact():
    """Repetition alone (no presence or frequency): the same values as torch's (HF's) division."""
    logits, rows, slots, counts, prompt, params = _inputs(4, 300, 4, [3, 1, 0])
    params[:, 1:] = 0.0
    want = logits.clone()
    reference.apply_penalties(want, rows, slots, counts, prompt, params)
    got = logits.clone()
    apply_penalties(got, rows, slots, counts, prompt, params)
    assert torch.equal(got, want)


def test_no_rows_changes_nothing():
    logits, _, _, counts, prompt, _ = _inputs(2, 40, 2, [0])
    before = logits.clone()
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    apply_penalties(logits, empty, empty, counts, prompt, torch.zeros(0, 3, device=DEVICE))
    assert torch.equal(logits, before)


@gpu
@requires_cuda
def test_gpu_real_shape():
    """Batch 64, every row penalized, Llama 3's vocabulary."""
    logits, rows, slots, counts, prompt, params = _inputs(64, 128256, 80, list(range(64)), device="cuda")
    want = logits.clone()
    reference.apply_penalties(want, rows, slots, counts, prompt, params)
    apply_penalties(logits, rows, slots, counts, prompt, params)
    assert_close(logits, want, torch.float32)


_COMPILE = """
import re, triton
from triton.backends.compiler import GPUTarget
from tandem.kernels.penalties import BLOCK, LAUNCH_OPTIONS, _penalties_kernel
types = {"logits_ptr": "*fp32", "rows_ptr": "*i64", "slots_ptr": "*i64", "counts_ptr": "*fp32",
         "prompt_ptr": "*u8", "params_ptr": "*fp32"}
signature = {name: types.get(name, "constexpr" if name == "BLOCK" else "i32") for name in _penalties_kernel.arg_names}
kernel = triton.compile(triton.compiler.ASTSource(_penalties_kernel, signature, {"BLOCK": BLOCK}),
                        target=GPUTarget("cuda", 90, 32), options=LAUNCH_OPTIONS)
ptx = kernel.asm["ptx"]
print(sorted(set(re.findall(r"\\b(?:div|fma|mad)\\.[a-z.]*f32", ptx))))  # float ops only
"""


def test_compiled_for_sm90_it_divides_exactly_and_fuses_no_multiply_add():
    """Outside the interpreter, no GPU needed: the PTX the launch options give."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['div.rn.f32']"


def test_one_binary_for_any_number_of_penalized_rows():
    """The rows and slots come as the two rows of one [2, n] tensor (engine.logits_process), so the
    slots' address moves with n: the launch's compile key must not (tests/kernels/launch_keys.py)."""
    from tests.kernels.launch_keys import recording

    from tandem.kernels import penalties

    vocab = 300
    logits, counts = torch.zeros(64, vocab), torch.zeros(64, vocab)
    prompt = torch.zeros(64, vocab, dtype=torch.bool)
    with recording(penalties, "_penalties_kernel") as launches:
        for n in range(1, 9):
            index = torch.arange(2 * n).view(2, n)
            apply_penalties(logits, index[0], index[1], counts, prompt, torch.ones(n, 3))
    assert len(launches.keys) == 8 and len(launches.distinct()) == 1
