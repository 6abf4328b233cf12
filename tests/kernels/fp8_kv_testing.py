"""The FP8 KV cache tests' inputs: E4M3 codes of make_paged_kv's caches with per-head scales."""

import torch
from kernel_testing import DEVICE, make_paged_kv

from tandem.kernels import reference

F8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_SCALE = {torch.float32: 1.0, torch.float16: 2.5, torch.bfloat16: 1.5}
HEAD_CONFIGS = [(2, 2, 64, 16), (4, 1, 128, 16), (8, 2, 32, 4)]  # (q heads, kv heads, head_dim, block): GQA 1, 4


def scales(num_kv_heads, device=DEVICE):
    """(k_scale, v_scale) [H]: powers of two as calibration makes them, and 0.0123 (a checkpoint's)."""
    k = torch.tensor([2.0**-5, 0.0123, 2.0**-3, 2.0**-6])[torch.arange(num_kv_heads) % 4]
    v = torch.tensor([0.0123, 2.0**-6, 2.0**-4, 2.0**-2])[torch.arange(num_kv_heads) % 4]
    return k.to(device), v.to(device)


def fp8_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, device=DEVICE):
    """make_paged_kv's keys and values as codes (its NaN slots stay NaN codes) and their scales."""
    k_cache, v_cache, tables = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, device)
    k_scale, v_scale = scales(num_kv_heads, device)
    return reference.quantize_kv_fp8(k_cache, k_scale), reference.quantize_kv_fp8(v_cache, v_scale), tables, k_scale, v_scale


def codes(t):
    return t.view(torch.uint8)


def ordinal(t):
    """E4M3 codes as integers in the order of their values (+0 and -0 both 0): neighbours differ by 1."""
    c = codes(t).int()
    return torch.where(c >= 128, 128 - c, c)


def rotary_table(max_position, head_dim, device=DEVICE):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
