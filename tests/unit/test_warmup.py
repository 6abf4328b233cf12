"""Prefill warm-up: one forward per query tile size, and the handoff's block gather and scatter,
on scratch blocks given back."""

from types import SimpleNamespace

import torch

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.warmup import QUERY_LENGTHS, warm_up_prefill
from tandem.kernels import ops


class _Runner:
    def __init__(self, device):
        self.device = torch.device(device)
        self.forwards = []
        self.kv_pool = SimpleNamespace(kv=torch.randn(2, 2, 64, 16, 1, 4))  # [L, 2, blocks, bs, H, D]

    def forward(self, chunks):
        (chunk,) = chunks
        self.forwards.append((len(chunk.token_ids), chunk.num_computed, len(chunk.block_ids)))


def test_one_forward_per_tile_size_and_every_block_given_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner, allocator = _Runner("cuda"), BlockAllocator(64, 16)
    copies = []
    for name in ("gather_blocks", "scatter_blocks"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda kv, ids, *rest, real=real, name=name: (
            copies.append((name, ids.tolist())), real(kv, ids, *rest))[1])
    before = runner.kv_pool.kv.clone()
    warm_up_prefill(runner, allocator, max_num_tokens=2048)
    assert [n for n, _, _ in runner.forwards] == sorted(QUERY_LENGTHS)
    assert all(start == 0 and blocks == -(-n // 16) for n, start, blocks in runner.forwards)
    assert allocator.num_free == 64
    # each forward's blocks are gathered and scattered back: the handoff kernels compile, no data moves
    assert [name for name, _ in copies] == ["gather_blocks", "scatter_blocks"] * len(QUERY_LENGTHS)
    assert [len(ids) for name, ids in copies[::2]] == [-(-n // 16) for n in sorted(QUERY_LENGTHS)]
    assert torch.equal(runner.kv_pool.kv, before)


def test_capped_by_the_token_budget_and_skipped_off_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner, allocator = _Runner("cuda"), BlockAllocator(64, 16)
    warm_up_prefill(runner, allocator, max_num_tokens=48)
    assert [n for n, _, _ in runner.forwards] == [16, 32, 48]
    cpu = _Runner("cpu")
    assert warm_up_prefill(cpu, allocator, 2048) == 0.0 and cpu.forwards == []
