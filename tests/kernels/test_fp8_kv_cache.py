"""FP8 (E4M3) KV cache: every kernel that writes or reads the cache against its torch reference
(reference.quantize_kv_fp8 / dequantize_kv_fp8), in the interpreter on the CPU and compiled on a GPU.

The writes must store the reference's codes bit for bit (given the same rotated k); the reads
(prefill attention here, decode attention in test_fp8_decode_attention.py) are compared with the
reference's attention in fp32 over the same codes and scales. The scales
differ per KV head and include one that is not a power of two (as a checkpoint's may be)."""


import pytest
import torch
import triton
import triton.language as tl
from fp8_kv_testing import ATTN_SCALE, DTYPES, F8, HEAD_CONFIGS, codes, fp8_paged_kv, rotary_table, scales
from kernel_testing import DEVICE, assert_close, gpu, pairwise, poisoned, requires_cuda

from tandem.kernels import reference
from tandem.kernels.block_copy import gather_blocks, scatter_blocks
from tandem.kernels.decode_attention import decode_attention
from tandem.kernels.fp8_kv import quantize_kv_fp8, soft_round
from tandem.kernels.prefill_attention import prefill_attention
from tandem.kernels.rotary import rotary_kv_write


@triton.jit
def _quantize_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, quantize_kv_fp8(x, tl.load(scale_ptr), SOFT_ROUND), mask=offs < n)


@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 0.0123])
def test_quantize_stores_the_references_codes(scale):
    """Every E4M3 value and every midpoint between two (ties to even), subnormals, values past
    448 (saturated), -0.0 and random values: the kernel's codes are torch's."""
    values = torch.arange(256, dtype=torch.uint8).view(F8).float()
    values = values[~values.isnan()].sort().values
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([0.0, -0.0, 1e4, -1e4, 449.0, 464.0]),
                   torch.randn(4000) * 60, torch.randn(1000) * 1e-3]) * scale
    x = x.to(DEVICE)
    s = torch.tensor([scale], device=DEVICE)
    out = torch.empty(x.shape, dtype=F8, device=DEVICE)
    _quantize_kernel[(triton.cdiv(x.numel(), 1024),)](x, s, out, x.numel(), BLOCK=1024, SOFT_ROUND=soft_round())
    assert torch.equal(codes(out), codes(reference.quantize_kv_fp8(x[:, None], s)[:, 0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", [(4, 4, 64, 16), (8, 2, 128, 8),
                                                                              (6, 3, 16, 4)])
def test_rotary_writes_the_codes_of_the_rotated_k_and_v(dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    num_tokens, num_blocks = 11, 7
    q = torch.randn(num_tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) * 4).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    k[0, 0, :4] = 1e4  # saturates
    positions = torch.randint(0, 500, (num_tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[2, 7]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = poisoned(shape, F8), poisoned(shape, F8)
    k_scale, v_scale = scales(num_kv_heads)
    cos_sin = rotary_table(512, head_dim)
    q_rot, k_rot = rotary_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slots, k_scale, v_scale)
    ref_q, ref_k = reference.rotary_kv_write(q, k, v, positions, cos_sin, poisoned(shape, F8), poisoned(shape, F8),
                                             slots, k_scale, v_scale)
    assert_close(q_rot, ref_q, dtype)
    assert_close(k_rot, ref_k, dtype)
    valid = slots >= 0
    flat = lambda c: c.view(-1, num_kv_heads, head_dim)  # noqa: E731
    assert torch.equal(codes(flat(k_cache)[slots[valid]]), codes(reference.quantize_kv_fp8(k_rot[valid], k_scale)))
    assert torch.equal(codes(flat(v_cache)[slots[valid]]), codes(reference.quantize_kv_fp8(v[valid], v_scale)))
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    unwritten[slots[valid]] = False
    assert flat(k_cache)[unwritten].float().isnan().all() and flat(v_cache)[unwritten].float().isnan().all()


def _prefill(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, window, chunk,
             device=DEVICE):
    k_cache, v_cache, tables, k_scale, v_scale = fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, device)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens).cumsum(0)
    starts, lens = starts.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=device).to(dtype)
    chunk_kv = None
    if chunk:  # the chunk's own rows, unquantized; the cache's slots there are NaN codes
        chunk_kv = tuple(torch.randn(sum(q_lens), num_kv_heads, head_dim, device=device).to(dtype) for _ in "kv")
        for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
            for pos in range(seq_len - q_len, seq_len):
                block = tables[b, pos // block_size]
                k_cache[block, pos % block_size] = float("nan")
                v_cache[block, pos % block_size] = float("nan")
    scale = head_dim**-0.5
    out = prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, window, chunk_kv, k_scale, v_scale)
    chunk32 = None if chunk_kv is None else (chunk_kv[0].float(), chunk_kv[1].float())
    with torch.device(device):
        expected = reference.prefill_attention(q.float(), k_cache, v_cache, tables, starts, lens, scale, window,
                                               chunk32, k_scale, v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    return out, expected


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 5],
    "chunk": [False, True],
})
def test_prefill_attention_reads_codes_times_scales(dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                                                    window, chunk):
    """Chunked context (284 cached + 16 new), a fresh prompt, single tokens, an empty query."""
    out, expected = _prefill([300, 9, 40, 1, 12, 77], [16, 9, 1, 1, 0, 20], num_q_heads, num_kv_heads, head_dim,
                             block_size, dtype, window, chunk)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


def test_fp8_cache_without_scales_is_refused():
    k_cache, v_cache, tables, _, _ = fp8_paged_kv([5], 4, 1, 16)
    q = torch.randn(1, 2, 16, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="k_scale and v_scale"):
        decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.25)


@pytest.mark.parametrize("block_size, heads, head_dim", [(4, 2, 16), (16, 1, 64)])
def test_block_copy_moves_fp8_blocks_bit_for_bit(block_size, heads, head_dim):
    pool = torch.randn(3, 2, 10, block_size, heads, head_dim, device=DEVICE).mul(100).to(F8)
    pool.view(torch.uint8)[0, 0, 3, 0, 0, :2] = 0x7F  # a NaN code travels as it is
    block_ids = torch.tensor([7, 0, 3, 9], device=DEVICE)
    staging = gather_blocks(pool, block_ids)
    assert staging.dtype == F8 and torch.equal(codes(staging), codes(reference.gather_blocks(pool, block_ids)))
    expected = pool.clone()
    new = torch.randn(staging.shape, device=DEVICE).to(F8)
    reference.scatter_blocks(expected, block_ids, new)
    scatter_blocks(pool, block_ids, new)
    assert torch.equal(codes(pool), codes(expected))


# ---- real shapes on a GPU (tests/gpu and `bash scripts/gpu.sh tests` run these) -------------------

@gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize("num_kv_heads", [8, 32])
def test_gpu_rotary_real_shapes(num_tokens, num_kv_heads):
    hq, d, bs, num_blocks = 32, 128, 16, 512
    q = torch.randn(num_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads, d, device="cuda", dtype=torch.bfloat16) * 8
    v = torch.randn(num_tokens, num_kv_heads, d, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    slots = torch.randperm(num_blocks * bs, device="cuda")[:num_tokens]
    slots[::7] = -1
    shape = (num_blocks, bs, num_kv_heads, d)
    k_cache, v_cache = poisoned(shape, F8, "cuda"), poisoned(shape, F8, "cuda")
    k_scale, v_scale = scales(num_kv_heads, "cuda")
    _, k_rot = rotary_kv_write(q, k, v, positions, rotary_table(8192, d, "cuda"), k_cache, v_cache, slots,
                               k_scale, v_scale)
    valid = slots >= 0
    flat = lambda c: c.view(-1, num_kv_heads, d)  # noqa: E731
    assert torch.equal(codes(flat(k_cache)[slots[valid]]), codes(reference.quantize_kv_fp8(k_rot[valid], k_scale)))
    assert torch.equal(codes(flat(v_cache)[slots[valid]]), codes(reference.quantize_kv_fp8(v[valid], v_scale)))


@gpu
@requires_cuda
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(32, 32, 128), (32, 8, 128), (32, 8, 64)])
@pytest.mark.parametrize("chunk", [False, True])
def test_gpu_prefill_attention_real_shapes(num_q_heads, num_kv_heads, head_dim, chunk):
    """One 2048-token prompt in one chunk, and 1024 new tokens after 1024 cached ones, beside short rows."""
    for seq_lens, q_lens in (([2048], [2048]), ([2048, 300, 17], [1024, 300, 1])):
        out, expected = _prefill(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16, None,
                                 chunk, device=torch.device("cuda"))
        assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@gpu
@requires_cuda
def test_gpu_block_copy_fp8_pool():
    pool = torch.randn(32, 2, 256, 16, 8, 128, device="cuda").to(F8)
    ids = torch.randperm(256, device="cuda")[:100]
    staging = gather_blocks(pool, ids)
    assert torch.equal(codes(staging), codes(pool[:, :, ids]))
    other = torch.zeros_like(pool)
    scatter_blocks(other, ids, staging)
    assert torch.equal(codes(other[:, :, ids]), codes(pool[:, :, ids]))
