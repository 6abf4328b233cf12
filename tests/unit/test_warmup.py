"""Prefill warm-up: one forward per query tile size, and the handoff's block gather and scatter,
on scratch blocks given back."""

import contextlib
from types import SimpleNamespace

import torch

from tandem.engine.block_allocator import BlockAllocator
from tandem.engine.lora_weights import PROJECTION_TARGETS
from tandem.engine.warmup import QUERY_LENGTHS, warm_up_adapters, warm_up_mixed, warm_up_prefill
from tandem.kernels import ops


class _Runner:
    lora = None  # no LoRA slots

    def __init__(self, device):
        self.device = torch.device(device)
        self.forwards = []
        self.kv_pool = SimpleNamespace(kv=torch.randn(2, 2, 64, 16, 1, 4))  # [L, 2, blocks, bs, H, D]

    def forward(self, chunks):
        (chunk,) = chunks
        self.forwards.append((len(chunk.token_ids), chunk.num_computed, len(chunk.block_ids)))

    def warm_up_logits(self, max_rows):
        self.logit_rows = max_rows


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
    assert runner.logit_rows == ops.SKINNY_GEMM_ROWS_LIMIT  # lm_head's row tiles (warm_up_logits)


def test_capped_by_the_token_budget_and_skipped_off_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner, allocator = _Runner("cuda"), BlockAllocator(64, 16)
    warm_up_prefill(runner, allocator, max_num_tokens=48)
    assert [n for n, _, _ in runner.forwards] == [1, 16, 32, 48]
    cpu = _Runner("cpu")
    assert warm_up_prefill(cpu, allocator, 2048) == 0.0 and cpu.forwards == []


class _MixedRunner:
    def __init__(self, windows=(None,)):
        self.device = torch.device("cuda")
        self.dtype = torch.bfloat16
        self.config = SimpleNamespace(num_layers=len(windows), layer_sliding_window=lambda layer: windows[layer])
        self.kv_pool = SimpleNamespace(layer=lambda layer: (torch.empty(64, 16, 2, 8), torch.empty(64, 16, 2, 8)))
        self.steps = []

    def forward(self, chunks):
        *decode, chunk = chunks
        assert all(len(c.token_ids) == 1 for c in decode) and len(chunk.token_ids) > 1
        assert len({(c.seq_len, len(c.block_ids)) for c in decode}) == 1  # one context and table per step
        self.steps.append((len(decode), decode[0].seq_len, len(decode[0].block_ids), len(chunk.block_ids)))


def test_a_mixed_step_per_form_of_the_decode_launch(monkeypatch):
    """One mixed step (decode rows of one context, then a prompt chunk) for each form the decode
    attention's rules give over the rows the token budget leaves beside a chunk and the tables the
    sequence limit (or the free blocks) reach, for each layer's window; every block is free again after."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    asked = []

    def variants(max_rows, max_width, q_dtype, k_cache, window):
        asked.append((max_rows, max_width, window))
        return {"one row, one block": (1, 1), "wide": (16, 4), "wide and long": (16, 19)}

    monkeypatch.setattr(ops, "decode_attention_variants", variants)
    runner, allocator = _MixedRunner(windows=(None, 24, None)), BlockAllocator(64, 16)
    assert warm_up_mixed(runner, allocator, max_batch_size=40, max_seq_len=300, max_num_tokens=32) == 3
    assert sorted(asked, key=str) == [(16, 19, 24), (16, 19, None)]  # 16 rows + a 16-token chunk = the budget
    # (rows, context, table width, chunk blocks): the last table's 19 blocks hold the limit's 300 tokens
    assert runner.steps == [(1, 16, 1, 1), (16, 64, 4, 1), (16, 300, 19, 1)]
    assert allocator.num_free == 64
    # the free blocks bound the tables: 63 blocks (one is the chunk's)
    asked.clear()
    assert warm_up_mixed(_MixedRunner(), allocator, 256, 4096, 8192) == 3 and asked == [(256, 63, None)]
    assert warm_up_mixed(SimpleNamespace(device=torch.device("cpu")), allocator, 8, 64, 64) == 0


class _AdapterWeights:
    """LoraWeights' slot bookkeeping: which slots hold an adapter, and the warm-up's zero adapter."""

    def __init__(self, occupied):
        self.max_loras, self.held, self.zero = len(occupied), list(occupied), None

    def occupied(self, slot):
        return self.held[slot] or self.zero == slot

    @contextlib.contextmanager
    def zero_adapter(self, slot, targets):
        assert not self.held[slot]
        self.zero = (slot, frozenset(targets))
        try:
            yield
        finally:
            self.zero = None


def test_adapter_steps_run_the_token_counts_again_in_an_empty_slot(monkeypatch):
    """Every row of each forward carries the first empty slot, holding a zero adapter only while
    the warm-up runs: of every projection, then of neither o nor down (their norms add no LoRA
    then); without LoRA slots, or with every slot taken, nothing runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    weights = _AdapterWeights([True, False, False])
    seen = []
    runner = _Runner("cuda")
    runner.lora = SimpleNamespace(weights=weights)
    runner.forward = lambda chunks: seen.append([(len(c.token_ids), c.lora_slot, weights.zero) for c in chunks])
    allocator = BlockAllocator(64, 16)
    assert warm_up_adapters(runner, allocator, max_num_tokens=2048) == 2 * len(QUERY_LENGTHS)
    every = frozenset(PROJECTION_TARGETS)
    assert seen == ([[(n, 1, (1, every))] for n in sorted(QUERY_LENGTHS)]
                    + [[(n, 1, (1, every - {"o_proj", "down_proj"}))] for n in sorted(QUERY_LENGTHS)])
    assert weights.zero is None and allocator.num_free == 64
    runner.lora = SimpleNamespace(weights=_AdapterWeights([True, True]))
    assert warm_up_adapters(runner, allocator, 2048) == 0
    runner.lora = None
    assert warm_up_adapters(runner, allocator, 2048) == 0
