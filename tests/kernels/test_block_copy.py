import pytest
import torch
from kernel_testing import DEVICE, DTYPES, gpu, requires_cuda

from tandem.kernels import reference
from tandem.kernels.block_copy import gather_blocks, scatter_blocks


def _pool(num_layers, num_blocks, block_size, heads, head_dim, dtype, device=DEVICE):
    return torch.randn(num_layers, 2, num_blocks, block_size, heads, head_dim, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size, heads, head_dim", [(4, 2, 16), (16, 1, 64)])
def test_gather_then_scatter(dtype, block_size, heads, head_dim):
    pool = _pool(3, 10, block_size, heads, head_dim, dtype)
    block_ids = torch.tensor([7, 0, 3, 9], device=DEVICE)
    staging = gather_blocks(pool, block_ids)
    assert staging.is_contiguous()
    assert torch.equal(staging, reference.gather_blocks(pool, block_ids))

    expected = pool.clone()
    new = torch.randn_like(staging.float()).to(dtype)
    reference.scatter_blocks(expected, block_ids, new)
    scatter_blocks(pool, block_ids, new)
    assert torch.equal(pool, expected)  # untouched blocks too


def test_scatter_casts_and_pool_view():
    big = _pool(2, 12, 4, 2, 16, torch.float16)
    pool = big[:, :, 2:]  # a view: block stride of the big pool, offset start
    block_ids = torch.tensor([1, 8], dtype=torch.int32, device=DEVICE)
    staging = torch.randn(2, 2, 2, 4, 2, 16, device=DEVICE)  # fp32, cast on the way in
    expected = pool.clone()
    reference.scatter_blocks(expected, block_ids, staging)
    scatter_blocks(pool, block_ids, staging)
    torch.testing.assert_close(pool, expected)
    assert torch.equal(gather_blocks(pool, block_ids), reference.gather_blocks(pool, block_ids))


@pytest.mark.parametrize("words", [torch.int64, torch.int32, torch.uint8])
def test_gather_into_and_scatter_from_a_block_major_buffer(words):
    """The host KV tier's form: a pool's bytes as integer words, gathered into (and scattered
    from) the [L, 2, n, ...] view of a [n, L, 2, ...] buffer, each block's layers contiguous."""
    pool = _pool(3, 10, 4, 2, 16, torch.bfloat16).view(torch.uint8).view(words)
    block_ids = torch.tensor([7, 0, 3, 9], device=DEVICE)
    buffer = torch.full((4,) + (3, 2) + tuple(pool.shape[3:]), -1, dtype=words, device=DEVICE)
    gather_blocks(pool, block_ids, out=buffer.movedim(0, 2))
    for j, block in enumerate(block_ids.tolist()):
        assert torch.equal(buffer[j], pool[:, :, block])
    fresh = _pool(3, 10, 4, 2, 16, torch.bfloat16).view(torch.uint8).view(words)
    expected = fresh.clone()
    reference.scatter_blocks(expected, block_ids.flip(0), buffer.movedim(0, 2))
    scatter_blocks(fresh, block_ids.flip(0), buffer.movedim(0, 2))
    assert torch.equal(fresh, expected)
    assert torch.equal(fresh[:, :, 9], pool[:, :, 7])  # buffer[0] went to block 9


def test_no_blocks():
    pool = _pool(1, 4, 4, 1, 16, torch.float32)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert gather_blocks(pool, empty).shape == (1, 2, 0, 4, 1, 16)
    before = pool.clone()
    scatter_blocks(pool, empty, gather_blocks(pool, empty))
    assert torch.equal(pool, before)


@gpu
@requires_cuda
@pytest.mark.parametrize("num_ids", [1, 64, 700])
def test_gpu_real_shapes_bf16(num_ids):
    pool = _pool(32, 1024, 16, 8, 128, torch.bfloat16, "cuda")
    block_ids = torch.randperm(1024, device="cuda")[:num_ids]
    staging = gather_blocks(pool, block_ids)
    assert torch.equal(staging, reference.gather_blocks(pool, block_ids))
    expected = pool.clone()
    new = torch.randn_like(staging)
    reference.scatter_blocks(expected, block_ids, new)
    scatter_blocks(pool, block_ids, new)
    assert torch.equal(pool, expected)
