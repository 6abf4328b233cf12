"""Rotary embedding tables, computed exactly as transformers computes inv_freq.

The cache layout is the one ``tandem.kernels.reference.rotary_kv_write`` reads:
row p = [cos(p * inv_freq) | sin(p * inv_freq)], i.e. [max_position, head_dim].
"""

from __future__ import annotations

import math

import torch

from tandem.engine.config import ModelConfig


def compute_inv_freq(config: ModelConfig) -> torch.Tensor:
    """-> [head_dim // 2] fp32 on the CPU (a one-off; HF does the same arithmetic)."""
    dim = config.head_dim
    # int64 arange then float, as HF does, so the exponents round identically
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by factor, interpolate between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(config: ModelConfig, max_position: int, device: torch.device | str) -> torch.Tensor:
    """-> [max_position, head_dim] fp32: cos in the first half, sin in the second."""
    inv_freq = compute_inv_freq(config).to(device)
    positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
