import pytest
import torch
from kernel_testing import DEVICE, DTYPES, assert_close, gpu, poisoned, requires_cuda

from tandem.kernels import reference
from tandem.kernels.rotary import rotary_kv_write


def _cos_sin_cache(max_position, head_dim, dtype=torch.float32, device=DEVICE):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)  # [max_pos, D]


def _run_both(q, k, v, positions, cos_sin, num_blocks, block_size, slot_mapping, cache_dtype):
    shape = (num_blocks, block_size, k.shape[1], k.shape[2])
    k_cache, v_cache = poisoned(shape, cache_dtype, q.device), poisoned(shape, cache_dtype, q.device)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = rotary_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    ref_q, ref_k = reference.rotary_kv_write(q, k, v, positions, cos_sin, ref_k_cache, ref_v_cache, slot_mapping)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert_close(q_rot, ref_q, q.dtype)
    assert_close(k_rot, ref_k, q.dtype)
    # written slots match, and skipped / unused slots are still NaN
    atol, rtol = (1e-6, 1e-6) if cache_dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(k_cache.float(), ref_k_cache.float(), equal_nan=True, atol=atol, rtol=rtol)
    torch.testing.assert_close(v_cache.float(), ref_v_cache.float(), equal_nan=True, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size",
    [(4, 4, 64, 16), (8, 2, 128, 8), (8, 1, 32, 4), (6, 3, 16, 4)],
)
def test_matches_reference(dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    num_tokens, num_blocks = 11, 7
    q = torch.randn(num_tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    positions = torch.randint(0, 500, (num_tokens,), device=DEVICE)
    slot_mapping = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slot_mapping[[2, 7]] = -1  # CUDA-graph padding: rotated, not written
    _run_both(q, k, v, positions, _cos_sin_cache(512, head_dim), num_blocks, block_size, slot_mapping, dtype)


def test_views_of_fused_qkv_and_bf16_cos_sin():
    """The engine passes q, k, v as column slices of one qkv projection."""
    num_tokens, hq, hk, d = 5, 4, 2, 32
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * d, device=DEVICE).to(torch.bfloat16)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(num_tokens, hq, d), k.view(num_tokens, hk, d), v.view(num_tokens, hk, d)
    positions = torch.tensor([0, 1, 2, 40, 41], dtype=torch.int32, device=DEVICE)
    slot_mapping = torch.tensor([3, 4, 5, 9, -1], device=DEVICE)
    cos_sin = _cos_sin_cache(64, d, torch.bfloat16)
    _run_both(q, k, v, positions, cos_sin, 4, 4, slot_mapping, torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize("num_kv_heads", [8, 32])
def test_gpu_real_shapes_bf16(num_tokens, num_kv_heads):
    hq, d, bs, num_blocks = 32, 128, 16, 512
    q = torch.randn(num_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(num_tokens, num_kv_heads, d, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    slot_mapping = torch.randperm(num_blocks * bs, device="cuda")[:num_tokens]
    slot_mapping[::7] = -1
    cos_sin = _cos_sin_cache(8192, d, device="cuda")
    shape = (num_blocks, bs, num_kv_heads, d)
    k_cache = poisoned(shape, torch.bfloat16, "cuda")
    v_cache = poisoned(shape, torch.bfloat16, "cuda")
    ref_k_cache, ref_v_cache = poisoned(shape, torch.float32, "cuda"), poisoned(shape, torch.float32, "cuda")
    q_rot, k_rot = rotary_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    ref_q, ref_k = reference.rotary_kv_write(
        q.float(), k.float(), v.float(), positions, cos_sin, ref_k_cache, ref_v_cache, slot_mapping
    )
    assert_close(q_rot, ref_q, torch.bfloat16)
    assert_close(k_rot, ref_k, torch.bfloat16)
    torch.testing.assert_close(k_cache.float(), ref_k_cache, equal_nan=True, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(v_cache.float(), ref_v_cache, equal_nan=True, atol=0, rtol=0)
