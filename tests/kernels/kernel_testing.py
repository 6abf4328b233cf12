"""Shared helpers of the kernel tests (a unique module name: tests/ has no packages)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# small-shape tests run where the kernels run: compiled on a GPU, interpreted on the CPU
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# atol, rtol of a kernel's output against the reference computed in fp32
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


# TANDEM_KERNEL_CASES=all: every combination of a pairwise-covered test's settings
ALL_CASES = os.environ.get("TANDEM_KERNEL_CASES") == "all"


def pairwise(axes: dict[str, list]):
    """pytest.mark.parametrize over cases in which every pair of values of two axes meets at least
    once (all-pairs): a few cases instead of the whole product. An axis may name several
    arguments ("num_q_heads, num_kv_heads"), each of its values a tuple of theirs. Cases are
    chosen greedily (the one covering most of the pairs left, the first such), so the same every
    run; with TANDEM_KERNEL_CASES=all, every combination."""
    names, choices = list(axes), [list(v) for v in axes.values()]
    product = list(itertools.product(*(range(len(c)) for c in choices)))

    def pairs(case: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}

    if ALL_CASES or len(axes) < 2:
        chosen = product
    else:
        left, chosen = set().union(*map(pairs, product)), []
        while left:
            best = max(product, key=lambda case: len(pairs(case) & left))
            chosen.append(best)
            left -= pairs(best)

    def flat(case):
        out = []
        for name, c, k in zip(names, choices, case):
            out.extend(c[k] if "," in name else (c[k],))
        return tuple(out)

    argnames = ", ".join(names)
    if "," not in argnames:  # one argument: its values themselves
        return pytest.mark.parametrize(argnames, [choices[0][case[0]] for case in chosen])
    return pytest.mark.parametrize(argnames, [flat(case) for case in chosen])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert not torch.isnan(actual).any(), "output has NaN (unwritten or bad masking)"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol * scale, rtol=rtol * scale)


def poisoned(shape, dtype, device=DEVICE) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device=DEVICE, spare_blocks=3):
    """Random keys/values for each sequence in shuffled (non-contiguous) blocks.

    Slots past each sequence's end are NaN and unused block-table entries point
    far outside the pool, so a kernel that reads what it must mask fails.
    -> k_cache, v_cache [num_blocks, block_size, H, D], block_tables [B, max_blocks] int32
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks)
    width = max(blocks_per_seq + [1]) + 1
    block_tables = torch.full((len(seq_lens), width), 1 << 30, dtype=torch.int32)
    k_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), dtype, "cpu")
    v_cache = poisoned((num_blocks, block_size, num_kv_heads, head_dim), dtype, "cpu")
    used = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = perm[used:used + n]
        used += n
        block_tables[b, :n] = ids.int()
        for cache in (k_cache, v_cache):
            values = torch.full((n * block_size, num_kv_heads, head_dim), float("nan"))
            values[:seq_len] = torch.randn(seq_len, num_kv_heads, head_dim)
            cache[ids] = values.view(n, block_size, num_kv_heads, head_dim).to(dtype)
    return k_cache.to(device), v_cache.to(device), block_tables.to(device)



def new_token_rows(seq_lens, tables, k_cache, v_cache, block_size, num_q_heads, head_dim, dtype, padded_row,
                   device=DEVICE):
    """One decode row per sequence for the new-token kernels: its position (the last of its
    length), its cache slot (NaN in both caches until written; -1 for ``padded_row``, a CUDA-graph
    padding row that reads what is there and writes nothing), and random q, k, v in ``dtype``.
    Returns (q, k, v, positions, slots, lens)."""
    num_kv_heads = k_cache.shape[-2]
    n = len(seq_lens)
    positions = torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64, device=device)
    slots = tables[torch.arange(n), positions // block_size].long() * block_size + positions % block_size
    for row, slot in enumerate(slots.tolist()):
        if row == padded_row:
            slots[row] = -1
        else:
            k_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
            v_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
    q = torch.randn(n, num_q_heads, head_dim, device=device).to(dtype)
    k = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
    return q, k, v, positions, slots, torch.tensor(seq_lens, dtype=torch.int32, device=device)

def random_fp8(rows, K, scale=1.0, device=DEVICE) :
    """A random weight's FP8 form, rows of different magnitudes (so their scales differ)."""
    from tandem.kernels.fp8_weight import quantize_weight

    w = scale * torch.randn(rows, K, device=device) / K**0.5 * torch.rand(rows, 1, device=device).add(0.5)
    return quantize_weight(w)


def shaped_like(shape, stride=None, cuda=True, dtype=torch.bfloat16):
    """A stand-in with a tensor's shape, strides, dtype and device kind (the dispatch rules read only these)."""
    if stride is None:
        stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    return types.SimpleNamespace(is_cuda=cuda, shape=torch.Size(shape), dtype=dtype, dim=lambda: len(shape),
                                 stride=lambda i=None: stride if i is None else stride[i])


def run_ptx_check(script: str) -> str:
    """Run ``tests/kernels/<script>`` (a check that compiles kernels for sm90 and reads their PTX)
    in a process of its own, outside the interpreter; -> its stdout, after asserting it passed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, str(here / script)], cwd=here.parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def force_ids_in_registers(monkeypatch, value: bool | None) -> None:
    """Decode attention's block ids loaded once into registers (True), per tile (False), or as
    the shape rule says (None), for every launch in the test."""
    from tandem.kernels import decode_attention

    if value is None:
        return
    rule = decode_attention._tile_config
    monkeypatch.setattr(decode_attention, "_tile_config", lambda *args: (*rule(*args)[:3], value))
