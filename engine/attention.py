"""Attention metadata for one forward over a flattened, unpadded batch.

A forward runs a list of ``SeqChunk``s: for each sequence, the new tokens of
this step (a prompt chunk, or one decode token), how many of its tokens are
already in the KV cache, and its block table. The tokens of all sequences are
concatenated (no padding); the metadata says where each sequence's tokens are
and where their K/V go. It is passed explicitly to the model (no global
context), with the layouts of ``tandem.kernels.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.device_copy import tensor_on
from tandem.engine.lora_batch import LoraBatch


@dataclass
class SeqChunk:
    token_ids: list[int]  # the new tokens of this forward
    num_computed: int  # tokens of this sequence already in the KV cache
    block_ids: list[int]  # the sequence's full block table (may cover more than needed)
    lora_slot: int = -1  # the device slot of the sequence's LoRA adapter (engine.lora_manager); -1: none

    @property
    def seq_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, KV length including this forward's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with block 0
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written (-1 = skip)
    positions: torch.Tensor  # [T] int64, num_computed + i
    logits_indices: torch.Tensor  # [B] int64, index in T of each sequence's last new token
    is_decode: bool  # every sequence has exactly one new token
    # a mixed step: its leading one-token sequences (decode rows) take the decode attention,
    # the rest (prompt chunks) the prefill attention, over the same GEMMs
    num_decode: int = 0  # the leading sequences with one new token (all of them when is_decode)
    prefill_query_start_loc: torch.Tensor | None = None  # [B - num_decode + 1] int32, from 0: a mixed step's
    # the rows that carry a LoRA adapter, by slot (engine.lora_batch); None: no row does (the
    # projections are the base model's alone)
    lora: LoraBatch | None = None

    @property
    def is_mixed(self) -> bool:
        """Decode rows first, then at least one sequence of several new tokens."""
        return 0 < self.num_decode < self.num_seqs

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def build_metadata(seqs: list[SeqChunk], block_size: int, device: torch.device | str) -> AttentionMetadata:
    """Build the metadata on the host in Python lists, then one asynchronous copy to ``device``
    (``upload``)."""
    if not seqs:
        raise ValueError("build_metadata needs at least one sequence")
    query_start_loc = [0]
    seq_lens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for i, seq in enumerate(seqs):
        _check(i, seq, block_size)
        query_start_loc.append(query_start_loc[-1] + len(seq.token_ids))
        seq_lens.append(seq.seq_len)
        positions.extend(range(seq.num_computed, seq.seq_len))
        slots.extend(_slots(seq, block_size))
    max_blocks = max(len(seq.block_ids) for seq in seqs)
    tables: list[int] = []
    for seq in seqs:
        tables.extend(seq.block_ids)
        tables.extend([0] * (max_blocks - len(seq.block_ids)))
    num_decode = next((i for i, seq in enumerate(seqs) if len(seq.token_ids) != 1), len(seqs))
    mixed = 0 < num_decode < len(seqs)
    prefill_starts = [q - num_decode for q in query_start_loc[num_decode:]] if mixed else []
    logits_indices = [end - 1 for end in query_start_loc[1:]]
    starts, lens, block_tables, slot_mapping, positions_t, logits_t, prefill_t = upload(
        [query_start_loc, seq_lens, tables, slots, positions, logits_indices, prefill_starts], device)
    return AttentionMetadata(
        query_start_loc=starts.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        block_tables=block_tables.view(len(seqs), max_blocks).to(torch.int32),
        slot_mapping=slot_mapping,
        positions=positions_t,
        logits_indices=logits_t,
        is_decode=num_decode == len(seqs),
        num_decode=num_decode,
        prefill_query_start_loc=prefill_t.to(torch.int32) if mixed else None,
    )


def build_input_ids(seqs: list[SeqChunk], device: torch.device | str) -> torch.Tensor:
    """-> [T] int64, the new tokens of every sequence, concatenated in order."""
    return upload([[t for seq in seqs for t in seq.token_ids]], device)[0]


ROW_ALIGN = 2  # int64s: each row starts 16 bytes into the copy, as a fresh tensor would


def upload(rows: list[list[int]], device: torch.device | str) -> list[torch.Tensor]:
    """Lists of ints -> int64 tensors on ``device``, in one copy. On CUDA the copy is from pinned
    memory and asynchronous: a copy from pageable memory waits for every kernel already queued on
    the stream, which would stall a step launched while the previous one runs. Each row starts at a
    multiple of 16 bytes: a Triton kernel is compiled apart for a pointer that is not, so rows
    placed by the lengths before them would compile kernels during traffic
    (tests/engine/test_warm_up_coverage.py)."""
    values: list[int] = []
    starts = []
    for row in rows:
        values.extend([0] * (-len(values) % ROW_ALIGN))
        starts.append(len(values))
        values.extend(row)
    flat = tensor_on(values, device)
    return [flat[at : at + len(row)] for at, row in zip(starts, rows)]


def _slots(seq: SeqChunk, block_size: int) -> list[int]:
    """Where each new token's K/V goes: its block's first slot plus its offset, a block's run at a time."""
    out: list[int] = []
    pos, end = seq.num_computed, seq.seq_len
    while pos < end:
        block, offset = divmod(pos, block_size)
        n = min(block_size - offset, end - pos)
        first = seq.block_ids[block] * block_size + offset
        out.extend(range(first, first + n))
        pos += n
    return out


def _check(index: int, seq: SeqChunk, block_size: int) -> None:
    if not seq.token_ids:
        raise ValueError(f"sequence {index} has no new tokens")
    if seq.num_computed < 0:
        raise ValueError(f"sequence {index} has num_computed={seq.num_computed} < 0")
    capacity = len(seq.block_ids) * block_size
    if capacity < seq.seq_len:
        raise ValueError(
            f"sequence {index} needs {seq.seq_len} KV slots but its {len(seq.block_ids)} blocks "
            f"of {block_size} hold {capacity}"
        )
