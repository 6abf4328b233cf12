import sys

import pytest

from tandem.engine.block_allocator import BlockAllocator, OutOfBlocks, blocks_for


def test_module_is_torch_free():
    import importlib

    sys.modules.pop("tandem.engine.block_allocator", None)
    before = "torch" in sys.modules
    importlib.import_module("tandem.engine.block_allocator")
    assert before or "torch" not in sys.modules


def test_allocate_and_free_counts():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    assert (alloc.num_free, alloc.num_total) == (8, 8)
    assert alloc.can_allocate(32) and not alloc.can_allocate(33)
    blocks = alloc.allocate(9)  # 9 tokens -> 3 blocks
    assert len(blocks) == 3 and len(set(blocks)) == 3
    assert alloc.num_free == 5
    alloc.free(blocks)
    assert alloc.num_free == 8


def test_out_of_blocks_changes_nothing():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(9)
    assert alloc.num_free == 2


def test_append_grows_only_at_block_boundaries():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    blocks = alloc.allocate(4)
    assert alloc.append(blocks, 4) == []
    assert alloc.can_append(blocks, 5)
    added = alloc.append(blocks, 5)
    assert len(added) == 1 and len(blocks) == 2
    assert not alloc.can_append(blocks, 17)


def test_reference_counts_for_sharing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    blocks = alloc.allocate(8)
    alloc.share(blocks)
    assert [alloc.ref_count(b) for b in blocks] == [2, 2]
    alloc.free(blocks)
    assert alloc.num_free == 2  # still held once
    alloc.free(blocks)
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.free(blocks)
    with pytest.raises(ValueError):
        alloc.share(blocks)


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]


def test_blocks_freed_while_a_step_is_on_the_device_wait_for_it():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    early, late = alloc.allocate(8), alloc.allocate(8)  # 2 + 2 blocks, 4 free
    alloc.step_launched(1)
    alloc.free(early)  # step 1 may still use them
    assert (alloc.num_free, alloc.num_held) == (4, 2)
    others = alloc.allocate_blocks(4)  # every free block: none of them a held one
    assert not set(early) & set(others) and not alloc.can_allocate(1)
    alloc.step_launched(2)  # step 2 queued behind step 1
    alloc.free(late)
    alloc.step_done(1)  # step 1 read back: its blocks go free, step 2's wait
    assert (alloc.num_free, alloc.num_held) == (2, 2)
    assert set(alloc.allocate_blocks(2)) == set(early)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(late)  # reference counts drop at once: a double free is still caught
    alloc.step_done(2)
    assert (alloc.num_free, alloc.num_held) == (2, 0)
    alloc.free(others)  # nothing on the device: a free is immediate
    assert alloc.num_free == 6
