"""Prefill warm-up: one forward per query tile size, on scratch blocks given back."""


import torch

from engine.block_allocator import BlockAllocator
from engine.warmup import QUERY_LENGTHS, warm_up_prefill


class _Runner:
    def __init__(self, device):
        self.device = torch.device(device)
        self.forwards = []

    def forward(self, chunks):
        (chunk,) = chunks
        self.forwards.append((len(chunk.token_ids), chunk.num_computed, len(chunk.block_ids)))


def test_one_forward_per_tile_size_and_every_block_given_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner, allocator = _Runner("cuda"), BlockAllocator(64, 16)
    warm_up_prefill(runner, allocator, max_num_tokens=2048)
    assert [n for n, _, _ in runner.forwards] == sorted(QUERY_LENGTHS)
    assert all(start == 0 and blocks == -(-n // 16) for n, start, blocks in runner.forwards)
    assert allocator.num_free == 64


def test_capped_by_the_token_budget_and_skipped_off_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner, allocator = _Runner("cuda"), BlockAllocator(64, 16)
    warm_up_prefill(runner, allocator, max_num_tokens=48)
    assert [n for n, _, _ in runner.forwards] == [16, 32, 48]
    cpu = _Runner("cpu")
    assert warm_up_prefill(cpu, allocator, 2048) == 0.0 and cpu.forwards == []
