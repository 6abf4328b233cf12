import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, poisoned, requires_cuda

from kernels import ops, reference
from kernels import skinny_stream_k as sk
from kernels.skinny_stream_k import _launch_stream_k, stream_k_linear, stream_k_silu_mul


def _weight(rows, K, scale=1.0, dtype=torch.float32, pad=0):
    """[rows, K] rows ``K + pad`` apart, NaN in the padding: a read past K poisons the sums."""
    base = torch.full((rows, K + pad), float("nan"), device=DEVICE)
    base[:, :K] = scale * torch.randn(rows, K, device=DEVICE) / K**0.5
    return base.to(dtype)[:, :K]


def _counters_zero(device=DEVICE):
    return int(sk._scratch[torch.device(device)][1].abs().sum()) == 0


# (M, rows, K, silu, (BLOCK_N, BLOCK_K, warps, stages, programs per SM), SMs): 16-row blocks and
# 32-wide K tiles, so a handful of programs share row blocks in every way
CASES = [
    (3, 37, 200, False, (16, 32, 4, 2, 1), 1),  # one program: every row block whole
    (3, 37, 200, False, (16, 32, 4, 2, 1), 4),  # 21 units over 4 programs: two contributors per shared block
    (17, 16, 520, False, (16, 32, 4, 3, 1), 5),  # one row block of 17 tiles over 5 programs: middle contributors
    (2, 130, 96, False, (16, 32, 4, 2, 2), 3),  # 27 units, 6 programs: segments of whole blocks and pieces
    (64, 41, 128, False, (16, 32, 4, 2, 1), 7),  # K whole tiles; M a full 64
    (17, 260, 520, True, (16, 64, 4, 3, 1), 3),  # SiLU·mul, I = 130: up rows start mid-block
    (5, 38, 200, True, (16, 32, 4, 2, 1), 6),
]


@pytest.mark.parametrize("M, rows, K, silu, config, sms", CASES)
def test_matches_reference_and_leaves_the_counters_zero(M, rows, K, silu, config, sms):
    """(The interpreter runs programs one after another, so a row block's last contributor is its
    highest: which one finishes a row block under real races is for the GPU tests.)"""
    x = torch.randn(M, K + 5, device=DEVICE)[:, :K]  # token rows K + 5 apart
    w = _weight(rows, K, scale=2.0 if silu else 1.0, pad=7)
    bias = None if silu else torch.randn(rows, device=DEVICE)
    y = poisoned((M, rows + 3), torch.float32)[:, :rows // 2 if silu else rows]  # output rows apart too
    _launch_stream_k(x, w, bias, y, silu, config, num_sms=sms)
    ref = reference.gemv_silu_mul(x, w) if silu else reference.gemv(x, w, bias)
    assert_close(y, ref, torch.float32)
    assert _counters_zero()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [2, 17, 128])
def test_public_functions_with_the_rule(dtype, M):
    x = torch.randn(M, 300, device=DEVICE).to(dtype)
    w = _weight(70, 300, dtype=dtype)
    assert_close(stream_k_linear(x, w), reference.gemv(x, w), dtype)
    g = _weight(2 * 45, 300, scale=2.0, dtype=dtype)
    assert_close(stream_k_silu_mul(x, g), reference.gemv_silu_mul(x, g), dtype)


def test_the_rule_is_the_skinny_gemms_tiles_one_program_per_sm():
    from kernels.skinny_gemm import tile_config as skinny_tiles

    for M, N, K, silu in [(64, 12288, 4096, False), (8, 22016, 4096, True), (128, 4096, 11008, False)]:
        assert sk.tile_config(M, N, K, silu) == skinny_tiles(M, N, K, silu)[:4] + (1,)


@pytest.mark.parametrize("row_blocks, k_tiles, programs", [(5, 7, 4), (1, 17, 5), (9, 3, 4), (192, 32, 132),
                                                           (64, 86, 132), (3, 2, 6)])
def test_shared_row_blocks_have_distinct_slots(row_blocks, k_tiles, programs):
    """The kernel's bookkeeping, replayed in Python: each program's segments; a shared row block's
    contributors are first..last by the formulas; no two of them, nor two row blocks, write the same
    slot or count on the same counter."""
    total = row_blocks * k_tiles
    per = -(-total // min(total, programs))
    programs = -(-total // per)
    contributors, slots_written = {}, set()
    for p in range(programs):
        unit, end = p * per, min((p + 1) * per, total)
        assert unit < end  # no program is empty
        while unit < end:
            rb = unit // k_tiles
            contributors.setdefault(rb, []).append(p)
            unit = min(end, (rb + 1) * k_tiles)
    counters = set()
    for rb, ps in contributors.items():
        first, last = rb * k_tiles // per, ((rb + 1) * k_tiles - 1) // per
        assert ps == list(range(first, last + 1))
        if first != last:
            assert first not in counters
            counters.add(first)
            for q in ps:
                slot = (q, 1 if q == first else 0)
                assert slot not in slots_written
                slots_written.add(slot)
    assert sorted(contributors) == list(range(row_blocks))


def test_ops_sends_decode_batches_to_the_stream_k_form_when_on(monkeypatch):
    picked = []
    monkeypatch.setattr(ops, "_triton_matmul", lambda *args: "skinny")
    monkeypatch.setattr(ops, "_pick", lambda name, x: picked.append(name) or (lambda *args: None))
    x, w = torch.zeros(4, 8), torch.zeros(8, 8)
    for flag, names in ((False, ["skinny_linear", "skinny_silu_mul"]), (True, ["stream_k_linear", "stream_k_silu_mul"])):
        monkeypatch.setattr(ops, "SKINNY_STREAM_K", flag)
        ops.linear(x, w)
        ops.gate_up_silu_mul(x, w)
        assert picked[-2:] == names


def test_bad_shapes_are_refused():
    x, w = torch.randn(2, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
    with pytest.raises(AssertionError):
        stream_k_linear(torch.randn(2, 8, device=DEVICE), w)
    with pytest.raises(AssertionError):
        stream_k_linear(torch.randn(129, 16, device=DEVICE), w)
    with pytest.raises(AssertionError):
        stream_k_silu_mul(x, torch.randn(5, 16, device=DEVICE))


_SHAPES = [(12288, 4096, False), (4096, 4096, False), (22016, 4096, True), (4096, 11008, False),
           (6144, 4096, False), (28672, 4096, True), (4096, 14336, False), (32000, 4096, False),
           (16384, 2048, True), (2048, 8192, False)]


@gpu
@requires_cuda
@pytest.mark.parametrize("M", [8, 64, 128])
@pytest.mark.parametrize("N, K, silu", _SHAPES)
def test_gpu_real_shapes_bf16_twice_alike(M, N, K, silu):
    """Real shapes on all SMs at once (the race between a row block's contributors); a second
    launch gives the same bits (the slots are added in program order) and zeroes the counters."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (2 * torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
    ys = []
    for _ in range(2):
        ys.append(poisoned((M, N // 2 if silu else N), torch.bfloat16, "cuda"))
        _launch_stream_k(x, w, None, ys[-1], silu)
    ref = (reference.gemv_silu_mul if silu else reference.gemv)(x.float(), w.float())
    assert_close(ys[0], ref, torch.bfloat16)
    assert torch.equal(ys[0], ys[1])
    assert _counters_zero("cuda:0")


@gpu
@requires_cuda
def test_gpu_cuda_graph_replay():
    """Captured after one eager launch (which sizes the scratch), replayed with new inputs, 20 times."""
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(12288, 4096, device="cuda") / 64).to(torch.bfloat16)
    y = stream_k_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = stream_k_linear(x, w)
    for _ in range(20):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_close(y, reference.gemv(x.float(), w.float()), torch.bfloat16)
    assert _counters_zero("cuda:0")
