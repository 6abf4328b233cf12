"""Attention metadata built from SeqChunks."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import SeqChunk, build_input_ids, build_metadata


def test_mixed_batch_metadata():
    seqs = [
        SeqChunk(token_ids=[5, 6, 7], num_computed=2, block_ids=[9, 3]),  # prefill chunk, positions 2..4
        SeqChunk(token_ids=[8], num_computed=6, block_ids=[1, 4, 0]),  # decode at position 6
    ]
    meta = build_metadata(seqs, block_size=4, device="cpu")
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [5, 7] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[9, 3, 0], [1, 4, 0]] and meta.block_tables.dtype == torch.int32
    # pos 2,3 -> block 9; pos 4 -> block 3 offset 0; pos 6 -> block 4 offset 2
    assert meta.slot_mapping.tolist() == [38, 39, 12, 18] and meta.slot_mapping.dtype == torch.int64
    assert meta.positions.tolist() == [2, 3, 4, 6]
    assert meta.logits_indices.tolist() == [2, 3]
    assert not meta.is_decode and meta.num_seqs == 2 and meta.num_tokens == 4
    assert build_input_ids(seqs, "cpu").tolist() == [5, 6, 7, 8]


def test_decode_only_batch():
    meta = build_metadata([SeqChunk([1], 0, [0]), SeqChunk([2], 4, [2, 5])], 4, "cpu")
    assert meta.is_decode and meta.logits_indices.tolist() == [0, 1] and meta.slot_mapping.tolist() == [0, 20]


@pytest.mark.parametrize(
    "seq, match",
    [
        (SeqChunk([1, 2], 7, [0, 1]), "needs 9 KV slots"),
        (SeqChunk([], 0, [0]), "no new tokens"),
        (SeqChunk([1], -1, [0]), "num_computed"),
    ],
)
def test_invalid_chunks_raise(seq, match):
    with pytest.raises(ValueError, match=match):
        build_metadata([seq], 4, "cpu")
