import pytest
import torch
from kernel_testing import force_ids_in_registers, DEVICE, DTYPES, assert_close, gpu, make_paged_kv, pairwise, requires_cuda

from tandem.kernels import decode_attention as decode_module
from tandem.kernels import decode_config
from tandem.kernels import reference
from tandem.kernels.decode_attention import DecodeWorkspace, decode_attention

# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 1, 4, 8 and every head size
HEAD_CONFIGS = [(2, 2, 64, 16), (4, 1, 128, 16), (8, 1, 64, 8), (8, 2, 32, 4)]
ATTN_SCALE = {torch.float32: 1.0, torch.float16: 2.5, torch.bfloat16: 1.5}


def _inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device=DEVICE):
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, device=device).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _expected(q, k_cache, v_cache, block_tables, seq_lens, scale, window):
    with q.device:  # the reference makes its masks with the default device
        return reference.decode_attention(
            q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, scale, window
        )


@pairwise({
    "dtype": DTYPES,
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 20],
    "num_splits": [1, 3, 8],
})
def test_matches_reference(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim, block_size, window, num_splits):
    """Odd lengths, partial blocks, a padded slot (seq_len 0 -> zeros), splits that
    are empty for short sequences; 3 splits is not a power of two."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    seq_lens = [1, 70, 33, 0, 130]
    inputs = _inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    out = decode_attention(*inputs, head_dim**-0.5, window)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert_close(out, _expected(*inputs, head_dim**-0.5, window), dtype, ATTN_SCALE[dtype])


@pairwise({
    "dtype": [torch.float32, torch.bfloat16],  # 32- and 64-token tiles
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 100],
    "num_splits": [1, 2, 3],
    "ids_in_registers": [False, True],
})
def test_tile_edges(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim, block_size, window, num_splits,
                    ids_in_registers):
    """Contexts at, one past and one short of whole tiles of 32 and 64, shorter than a tile, and empty;
    block ids loaded per tile or once into registers (from entry 0, or from a split's or window's
    first block)."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    force_ids_in_registers(monkeypatch, ids_in_registers)
    seq_lens = [64, 65, 63, 128, 129, 31, 1, 0, 257, 192, 97]
    inputs = _inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    out = decode_attention(*inputs, head_dim**-0.5, window)
    assert_close(out, _expected(*inputs, head_dim**-0.5, window), dtype, ATTN_SCALE[dtype])


@pairwise({
    "dtype": [torch.float32, torch.bfloat16],
    "num_q_heads, num_kv_heads, head_dim, block_size": HEAD_CONFIGS,
    "window": [None, 100],
    "num_splits": [1, 3],
    "ids_in_registers": [False, True],
})
def test_the_register_prefetch_form_gives_the_same_answer(monkeypatch, dtype, num_q_heads, num_kv_heads, head_dim,
                                                           block_size, window, num_splits, ids_in_registers):
    """REG_PREFETCH (a tuning form: the next tile loaded before a tile's math) over the tile edges'
    contexts, empty and one-token ones included: the reference's answer."""
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    force_ids_in_registers(monkeypatch, ids_in_registers)
    seq_lens = [64, 65, 63, 128, 129, 31, 1, 0, 257, 97]
    inputs = _inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    out = torch.full_like(inputs[0], float("nan"))
    decode_module._launch_decode_attention(*inputs, out, head_dim**-0.5, window, None, reg_prefetch=True)
    assert_close(out, _expected(*inputs, head_dim**-0.5, window), dtype, ATTN_SCALE[dtype])

def test_launch_settings_reach_the_kernels(monkeypatch):
    """The grid order is passed on (both orders give the same answer, so the answer tests
    cannot see it); the fused form prefetches at batches of up to PREFETCH_MAX_BATCH only,
    the plain form never."""
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, kwargs))

    monkeypatch.setattr(decode_module, "_decode_partial_kernel", Recorder())
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: 1)
    inputs = _inputs([5, 9, 2], 4, 2, 32, 4, torch.float32)  # 3 sequences, 2 KV heads
    for heads_first in (True, False):
        monkeypatch.setattr(decode_module, "HEADS_FIRST", heads_first)
        decode_attention(*inputs, 0.25)
        grid, kwargs = calls[-1]
        assert grid == ((2, 3, 1) if heads_first else (3, 2, 1))
        assert kwargs["HEADS_FIRST"] is heads_first and kwargs["PREFETCH"] is False
    monkeypatch.setattr(decode_module, "HEADS_FIRST", True)  # the tuning tuple's fifth element overrides the flag
    decode_module._launch_decode_attention(*inputs, torch.empty_like(inputs[0]), 0.25, None, None,
                                           (64, 4, 3, 1, False))
    assert calls[-1][0] == (3, 2, 1) and calls[-1][1]["num_stages"] == 3
    assert "maxnreg" not in calls[-1][1]  # the compiler's choice unless capped, and on CUDA only
    decode_module._launch_decode_attention(*inputs, torch.empty_like(inputs[0]), 0.25, None, None, max_registers=96)
    assert ("maxnreg" in calls[-1][1]) is inputs[0].is_cuda
    q, k_cache, v_cache, block_tables, seq_lens = inputs
    new = (q[:, :2], q[:, :2], (seq_lens - 1).long(), torch.zeros(16, 32), torch.zeros(3, dtype=torch.long))
    for max_batch, rows, prefetch in ((1, 1, True), (1, 3, False), (3, 3, True), (3, 1, True)):
        monkeypatch.setattr(decode_module, "PREFETCH_MAX_BATCH", max_batch)
        k, v, positions, cos_sin, slots = new
        decode_module.decode_attention_new_token(q[:rows], k[:rows], v[:rows], positions[:rows], cos_sin, k_cache,
                                                 v_cache, slots[:rows], block_tables[:rows], seq_lens[:rows], 0.25)
        assert calls[-1][1]["PREFETCH"] is prefetch and calls[-1][1]["NEW_TOKEN"] is True


def test_tile_rule_by_grid_width():
    """Wide grids of 16-bit head_dim 128 (num_seqs * num_kv_heads programs) take 32-token tiles on
    3 stages with the block ids in registers, 2 warps from WIDER_GRID; the rest the 64-token tile."""
    rule = decode_config._tile_config
    for dtype in (torch.bfloat16, torch.float16):
        assert rule(128, dtype, 64 * 32) == (32, 4, 3, True)  # llama2-7b batch 64
        assert rule(128, dtype, 128 * 32) == (32, 2, 3, True)  # llama2-7b batch 128
        assert rule(128, dtype, 128 * 8) == (32, 4, 3, True)  # llama3-8b batch 128
        assert rule(128, dtype, 64 * 8) == (64, 4, 2, False)  # llama3-8b batch 64
        assert rule(128, dtype, 8 * 32) == (64, 4, 2, False)  # batch 8
        assert rule(64, dtype, 256 * 8) == (64, 4, 2, False)  # head_dim 64: not measured
    assert rule(128, torch.float32, 4096) == (32, 4, 2, False)


def test_tile_rule_of_an_fp8_cache():
    """An FP8 cache (head_dim 128) from FP8_MIN_GRID programs: 4 warps, 2 stages, 128-token tiles,
    64-token ones from FP8_SMALL_TILE_GRID, the block ids in registers from WIDE_GRID; below
    FP8_MIN_GRID the 16-bit rule's tile; its products in fp16 by rule."""
    rule = decode_config._tile_config
    assert decode_config.FP8_F16_DOT is True
    for dtype in (torch.bfloat16, torch.float16):
        assert rule(128, dtype, 128 * 32, kv_fp8=True) == (64, 4, 2, True)  # llama2-7b batch 128
        assert rule(128, dtype, 128 * 8, kv_fp8=True) == (64, 4, 2, True)  # llama3-8b batch 128
        assert rule(128, dtype, 64 * 8, kv_fp8=True) == (64, 4, 2, False)  # llama3-8b batch 64
        assert rule(128, dtype, 8 * 8, kv_fp8=True) == (128, 4, 2, False)  # llama3-8b batch 8
        assert rule(128, dtype, 1 * 8, kv_fp8=True) == rule(128, dtype, 1 * 8)  # batch 1
        assert rule(64, dtype, 256 * 8, kv_fp8=True) == rule(64, dtype, 256 * 8)  # head_dim 64: not measured


def test_tile_override_is_checked(monkeypatch):
    from tandem.kernels import switches

    monkeypatch.setenv("TANDEM_DECODE_TILE", "32,4,2")
    assert switches.reload().decode_tile == (32, 4, 2)
    for bad in ("48,4,2", "64,3,2", "64,4", "a,b,c", "64,4,0"):
        monkeypatch.setenv("TANDEM_DECODE_TILE", bad)
        with pytest.raises(ValueError, match="TANDEM_DECODE_TILE"):
            switches.reload()
    monkeypatch.delenv("TANDEM_DECODE_TILE")
    assert switches.reload().decode_tile is None


def test_default_splits_and_passed_in_workspace():
    seq_lens = [5, 300, 17]
    inputs = _inputs(seq_lens, 8, 2, 64, 16, torch.float32)
    expected = _expected(*inputs, 0.125, None)
    assert_close(decode_attention(*inputs, 0.125), expected, torch.float32)

    workspace = DecodeWorkspace.allocate(8, 8, 64, max_splits=16, device=DEVICE)
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    assert_close(decode_attention(*inputs, 0.125, workspace=workspace), expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_nan_in_the_cache_is_not_hidden(monkeypatch, num_splits):
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: num_splits)
    q, k_cache, v_cache, block_tables, seq_lens = _inputs([40, 40], 2, 1, 16, 4, torch.float32)
    k_cache[block_tables[1, 2], 1] = float("nan")  # position 9 of sequence 1
    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25)
    assert not out[0].isnan().any() and out[1].isnan().all()


@pytest.mark.parametrize("ids_reg_max", [0, 8, 16, 512])
def test_block_ids_in_registers_only_up_to_their_limit(monkeypatch, ids_reg_max):
    """The share's block ids go into registers when they fit IDS_REG_MAX (a power of 2 covering
    the share plus one block); otherwise each tile loads its own, and a wide grid's tile falls
    back to the one made for per-tile loads. Same answer either way."""
    calls = []
    kernel = decode_module._decode_partial_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((kwargs["IDS_REG"], kwargs["BLOCK_N"], kwargs["num_stages"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(decode_module, "_decode_partial_kernel", Spy())
    monkeypatch.setattr(decode_module, "num_kv_splits", lambda *args: 1)
    monkeypatch.setattr(decode_module, "IDS_REG_MAX", ids_reg_max)
    monkeypatch.setattr(decode_config, "WIDE_GRID", 2)  # 3 sequences x 1 KV head: a "wide" grid here
    # 7 table entries (112 tokens) at 32-token tiles: a 128-token share, 8 + 1 entries -> 16
    inputs = _inputs([65, 3, 90], 4, 1, 128, 16, torch.bfloat16)
    out = decode_attention(*inputs, 128**-0.5)
    assert calls == [(16, 32, 3) if ids_reg_max >= 16 else (0, 64, 2)]
    assert_close(out, _expected(*inputs, 128**-0.5, None), torch.bfloat16, ATTN_SCALE[torch.bfloat16])


def test_num_splits_depends_on_shapes_only():
    cpu = torch.device("cpu")
    assert decode_config.num_kv_splits(1, 8, 100, cpu) == 1  # short context: one split
    assert decode_config.num_kv_splits(1, 1, 8192, cpu) > 1
    assert decode_config.num_kv_splits(1, 1, 10**7, cpu) <= decode_config.MAX_SPLITS


@gpu
@requires_cuda
@pytest.mark.parametrize("num_kv_heads", [8, 32])
@pytest.mark.parametrize("window", [None, 1024])
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
@pytest.mark.parametrize("ids_in_registers", [False, True])
def test_gpu_real_shapes_bf16(num_kv_heads, window, num_seqs, ids_in_registers, monkeypatch):
    force_ids_in_registers(monkeypatch, ids_in_registers)
    monkeypatch.setattr(decode_module, "IDS_REG_MAX", 1024)  # 8192 tokens at one split: 513 entries
    torch.manual_seed(num_seqs)
    seq_lens = torch.randint(1, 8193, (num_seqs,)).tolist()
    seq_lens[0] = 8192
    inputs = _inputs(seq_lens, 32, num_kv_heads, 128, 16, torch.bfloat16, "cuda")
    out = decode_attention(*inputs, 128**-0.5, window)
    assert_close(out, _expected(*inputs, 128**-0.5, window), torch.bfloat16, ATTN_SCALE[torch.bfloat16])


@gpu
@requires_cuda
def test_gpu_cuda_graph_replay():
    """Captured once, replayed after the sequences grew (and one became padding)."""
    num_seqs, hq, hk, d, bs = 8, 32, 8, 128, 16
    seq_lens = [100, 4000, 1, 2048, 333, 17, 7000, 64]
    new_lens = [101, 3990, 2, 2048, 334, 16, 7001, 0]
    q, k_cache, v_cache, block_tables, _ = _inputs(
        [max(a, b) for a, b in zip(seq_lens, new_lens)], hq, hk, d, bs, torch.bfloat16, "cuda"
    )
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    workspace = DecodeWorkspace.allocate(num_seqs, hq, d, device="cuda")
    static_q, static_lens = q.clone(), seq_lens_t.clone()
    decode_attention(static_q, k_cache, v_cache, block_tables, static_lens, d**-0.5, workspace=workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_attention(static_q, k_cache, v_cache, block_tables, static_lens, d**-0.5,
                                      workspace=workspace)
    new_lens = torch.tensor(new_lens, dtype=torch.int32, device="cuda")
    static_lens.copy_(new_lens)
    static_q.copy_(torch.randn_like(q))
    static_out.fill_(float("nan"))
    graph.replay()
    expected = _expected(static_q, k_cache, v_cache, block_tables, new_lens, d**-0.5, None)
    assert_close(static_out, expected, torch.bfloat16, ATTN_SCALE[torch.bfloat16])
