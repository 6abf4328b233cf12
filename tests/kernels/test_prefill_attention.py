import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, make_paged_kv, pairwise, requires_cuda

from tandem.kernels import reference
from tandem.kernels.prefill_attention import prefill_attention

# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 1, 4, 8 and every head size
HEAD_CONFIGS = [(2, 2, 64, 16), (4, 1, 128, 16), (8, 1, 64, 8), (8, 2, 32, 4)]
ATTN_SCALE = {torch.float32: 1.0, torch.float16: 2.5, torch.bfloat16: 1.5}


def _chunk_kv(seq_lens, q_lens, k_cache, v_cache, block_tables):
    """The chunk's keys and values apart from the cache, v a strided view as the engine's (a
    column range of the fused QKV output); the cache's slots at the chunk's positions are
    NaN, so a kernel that reads them there instead fails."""
    num_tokens, (_, block_size, num_kv_heads, head_dim) = sum(q_lens), k_cache.shape
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=k_cache.device).to(k_cache.dtype)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, device=k_cache.device).to(k_cache.dtype)
    v = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        for pos in range(seq_len - q_len, seq_len):
            block = block_tables[b, pos // block_size]
            k_cache[block, pos % block_size] = float("nan")
            v_cache[block, pos % block_size] = float("nan")
    return k, v


def _run(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, window, device=DEVICE,
         chunk=False):
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    query_start_loc = query_start_loc.to(device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    chunk_kv = _chunk_kv(seq_lens, q_lens, k_cache, v_cache, block_tables) if chunk else None
    out = prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens_t, scale, window, chunk_kv)
    q32, k32, v32 = q.float(), k_cache.float(), v_cache.float()
    chunk32 = None if chunk_kv is None else (chunk_kv[0].float(), chunk_kv[1].float())
    with torch.device(device):  # the reference makes its masks with the default device
        expected = reference.prefill_attention(q32, k32, v32, block_tables, query_start_loc, seq_lens_t, scale, window,
                                               chunk32)
    assert out.shape == q.shape and out.dtype == dtype
    return out, expected


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 200, 5],
})
def test_mixed_batch(dtype, num_q_heads, num_kv_heads, head_dim, block_size, window):
    """Chunked context (300 = 284 cached + 16 new), a fresh odd prompt, decode-like
    single tokens, a sequence with no new tokens, partial last blocks."""
    seq_lens = [300, 9, 40, 1, 12, 77]
    q_lens = [16, 9, 1, 1, 0, 20]
    out, expected = _run(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, window)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 200, 5],
})
def test_chunk_keys_read_from_chunk_kv(dtype, num_q_heads, num_kv_heads, head_dim, block_size, window):
    """chunk_kv: the chunk's own keys and values come from it (the cache holds NaN there),
    the cached context's through the block table; the same batch as test_mixed_batch."""
    seq_lens = [300, 9, 40, 1, 12, 77]
    q_lens = [16, 9, 1, 1, 0, 20]
    out, expected = _run(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, window,
                         chunk=True)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("chunk", [False, True])
def test_long_chunk_large_query_tiles(dtype, window, chunk):
    """Average query length 130: the widest BLOCK_M, several query tiles per sequence; a
    context of 70 keys (not a whole tile) before one chunk."""
    out, expected = _run([200, 131], [130, 130], 4, 2, 64, 16, dtype, window, chunk=chunk)
    assert_close(out, expected, dtype, ATTN_SCALE[dtype])


@pairwise({
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS[:3],
    "window": [None, 5],
    "chunk": [False, True],
})
def test_tiles_first_grid_order(monkeypatch, num_q_heads, num_kv_heads, head_dim, block_size, window, chunk):
    """The grid order the rule does not take (query tiles on axis 0, first to last): same answer;
    with chunk_kv, a 130-token chunk whose window starts past its first key tile."""
    monkeypatch.setattr("tandem.kernels.prefill_attention.HEAVY_FIRST", False)
    out, expected = _run([300, 9, 40, 1, 12, 200], [16, 9, 1, 1, 0, 130], num_q_heads, num_kv_heads, head_dim,
                         block_size, torch.bfloat16, window, chunk=chunk)
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])


def test_grid_order_reaches_the_kernel(monkeypatch):
    """HEAVY_FIRST puts the heads on grid axis 0 and is passed on (both orders give the same
    answer, so the answer tests cannot see it)."""
    from tandem.kernels import prefill_attention as prefill_module

    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, kwargs))

    monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", Recorder())
    for heavy_first in (True, False):
        monkeypatch.setattr(prefill_module, "HEAVY_FIRST", heavy_first)
        _run_kernel_only([40, 9], [40, 9], 6, 2, 32, 8)
        grid, kwargs = calls[-1]
        tiles = 49 // 32 + 2  # num_tokens // BLOCK_M + num_seqs (BLOCK_M 32 for an average of 24 queries)
        assert grid == ((6, tiles) if heavy_first else (tiles, 6)) and kwargs["HEAVY_FIRST"] is heavy_first
        assert kwargs["HAS_CHUNK"] is False


def _run_kernel_only(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size):
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, DEVICE)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=DEVICE)
    prefill_attention(q, k_cache, v_cache, block_tables, qsl, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                      head_dim**-0.5)


@gpu
@requires_cuda
@pytest.mark.parametrize("heavy_first", [False, True])
@pytest.mark.parametrize("num_kv_heads", [8, 32])
@pytest.mark.parametrize("window", [None, 1024])
@pytest.mark.parametrize("chunk", [False, True])
def test_gpu_real_shapes_bf16(num_kv_heads, window, heavy_first, chunk, monkeypatch):
    monkeypatch.setattr("tandem.kernels.prefill_attention.HEAVY_FIRST", heavy_first)
    seq_lens = [2048, 2012, 4000, 1000, 8192]
    q_lens = [2048, 512, 1, 1000, 700]
    torch.manual_seed(0)
    out, expected = _run(seq_lens, q_lens, 32, num_kv_heads, 128, 16, torch.bfloat16, window, "cuda", chunk=chunk)
    assert_close(out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])
