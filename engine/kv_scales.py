"""Scales of the FP8 KV cache: one fp32 number per layer and KV head, for K and for V.

An FP8 pool holds each key and value as the E4M3 code of x / scale (kernels/fp8_kv.py).
Prefill and decode workers copy blocks into each other's pools byte for byte, so every worker
of a cluster must hold the same scales; they are chosen from what every worker has without
asking another, its checkpoint, so that no exchange (and no start-up order) is needed:

1. A checkpoint that carries KV-cache scales (``model.layers.N.self_attn.k_scale`` /
   ``v_scale`` as llm-compressor's compressed-tensors and vLLM write them, ModelOpt's
   ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, the older single ``self_attn.kv_scale``):
   those, as given (a scalar per layer is every head's). They come from the producer's
   calibration over far more text than ours, and another engine reading the checkpoint
   quantizes alike.
2. Otherwise calibration at load: one forward of a fixed built-in English text
   (``CALIBRATION_TEXT``, through the model's tokenizer) into a pool in the model's dtype; per
   layer and KV head, the largest |k| (rotated, as cached) and |v| over its tokens, times
   ``MARGIN`` (4), / 448, rounded up to a power of two.

Why a power of two: E4M3 is a floating-point format, its relative step the same (2^-3) over
its whole normal range (2^-6 to 448), so a scale up to twice the smallest that fits costs
no precision, only one binade at the bottom of a range that spans almost 15. In return
two workers whose calibration forwards rounded differently (other kernels, other batch
shapes) still get the same scale unless a head's largest value sits within that difference
of a power-of-two boundary, and dividing and multiplying by the scale is exact, so the
kernels fold it into the softmax scale with no rounding of their own. Why a margin: the text
is short, and a prompt's keys and values may be larger than its; with 4 the text's largest
value maps to 56-112, leaving 4-8x before 448, where a value saturates (never overflows).
Every pool publishes a digest of its scales in its KV endpoint (``KVCachePool.kv_format``),
and a prefill worker whose digest differs refuses the handoff instead of writing codes the
decode worker would read under other scales.
"""

from __future__ import annotations

import math
import os

import structlog
import torch
from safetensors import safe_open

from tandem.cluster.checkpoint import gguf_file
from tandem.engine.attention import SeqChunk, build_input_ids, build_metadata
from tandem.engine.kv_cache import KVCachePool
from tandem.engine.loader import KV_SCALE_SUFFIXES, checkpoint_files
from tandem.kernels.reference import KV_FP8_MAX

log = structlog.get_logger(__name__)

MARGIN = 4.0
MAX_CALIBRATION_TOKENS = 512
_BLOCK_SIZE = 16

# Public-domain English prose (Lincoln's Gettysburg Address, 1863; the opening of Melville's
# Moby-Dick, 1851), a list, numbers and a line of code: a little of what prompts hold.
CALIBRATION_TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we \
are engaged in a great civil war, testing whether that nation, or any nation so conceived and \
so dedicated, can long endure. We are met on a great battle-field of that war. We have come to \
dedicate a portion of that field, as a final resting place for those who here gave their lives \
that that nation might live. It is altogether fitting and proper that we should do this.

Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in \
my purse, and nothing particular to interest me on shore, I thought I would sail about a little \
and see the watery part of the world. It is a way I have of driving off the spleen, and \
regulating the circulation.

Shopping list: 1. apples (6), 2. bread, 3. milk - 2 litres, 4. coffee; total $23.45 on 2024-03-17.
Q: What is the capital of France? A: The capital of France is Paris.
def add(a, b):
    return a + b  # print(add(2, 3)) -> 5
"""


def checkpoint_kv_scales(model_path: str, num_layers: int, num_kv_heads: int):
    """-> (k_scale, v_scale) [num_layers, num_kv_heads] fp32 from a safetensors checkpoint's
    KV-cache scales, or None when it has none (a GGUF file never does). A checkpoint with the
    scales of some layers only is refused: half its cache would be scaled by our guess."""
    if gguf_file(model_path) is not None or not os.path.isdir(model_path):
        return None
    found: dict[tuple[int, str], torch.Tensor] = {}
    for file in checkpoint_files(model_path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                hit = _scale_name(name)
                if hit is not None:
                    layer, which = hit
                    for part in ("k", "v") if which == "kv" else (which,):
                        found[(layer, part)] = f.get_tensor(name).float().flatten()
    if not found:
        return None
    missing = [(i, w) for i in range(num_layers) for w in "kv" if (i, w) not in found]
    if missing:
        raise ValueError(f"the checkpoint's KV-cache scales leave out layer {missing[0][0]}'s {missing[0][1]}_scale")
    out = []
    for which in "kv":
        rows = []
        for layer in range(num_layers):
            scale = found[(layer, which)]
            if scale.numel() not in (1, num_kv_heads):
                raise ValueError(f"layer {layer}'s {which}_scale has {scale.numel()} values, "
                                 f"neither 1 nor one per KV head ({num_kv_heads})")
            rows.append(scale.expand(num_kv_heads) if scale.numel() == 1 else scale)
        out.append(torch.stack(rows))
    return out[0], out[1]


def _scale_name(name: str) -> tuple[int, str] | None:
    """``model.layers.N.self_attn.<suffix>`` -> (N, "k" | "v" | "kv") for a KV-cache scale's name."""
    for suffix in KV_SCALE_SUFFIXES:
        if name.endswith(suffix) and name.startswith("model.layers."):
            layer = name[len("model.layers."):].split(".", 1)[0]
            if layer.isdigit():
                return int(layer), suffix.rsplit(".", 1)[1].removesuffix("_scale")
    return None


def calibration_tokens(tokenizer_path: str | None, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT through the model's tokenizer (its special tokens too, as a prompt gets
    them), at most MAX_CALIBRATION_TOKENS. A checkpoint without a tokenizer (random-weight
    benchmarks) gets a fixed pseudo-random sequence instead: the same in every worker."""
    ids = None
    if tokenizer_path is not None:
        try:
            from tandem.cluster.tokenizer import load_tokenizer

            ids = load_tokenizer(tokenizer_path)(CALIBRATION_TEXT).input_ids
        except Exception as exc:  # no tokenizer files: the fallback below, the same in every worker
            log.warning("no tokenizer for the KV-scale calibration: a fixed token sequence instead", error=str(exc))
    if not ids:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (MAX_CALIBRATION_TOKENS,), generator=generator).tolist()
    return [t for t in ids if 0 <= t < vocab_size][:MAX_CALIBRATION_TOKENS]


@torch.inference_mode()
def calibrate_kv_scales(model, config, token_ids: list[int], device: torch.device, dtype: torch.dtype):
    """One forward of ``token_ids`` into a scratch pool in the model's dtype -> (k_scale, v_scale)
    [num_layers, num_kv_heads] fp32: pow2ceil(amax * MARGIN / 448) per layer and KV head."""
    n = len(token_ids)
    num_blocks = -(-n // _BLOCK_SIZE)
    pool = KVCachePool(config.num_layers, num_blocks, _BLOCK_SIZE, config.num_kv_heads, config.head_dim, dtype, device)
    try:
        chunk = SeqChunk(list(token_ids), 0, list(range(num_blocks)))
        meta = build_metadata([chunk], _BLOCK_SIZE, device)
        model(build_input_ids([chunk], device), meta.positions, pool, meta)
        kv = pool.kv.reshape(config.num_layers, 2, num_blocks * _BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        amax = kv[:, :, :n].abs().amax(dim=(2, 4)).float().cpu()  # [L, 2, H]
    finally:
        pool.close()
    scales = power_of_two_scales(amax)
    return scales[:, 0].contiguous(), scales[:, 1].contiguous()


def power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= amax * MARGIN / 448, elementwise (a head whose values were all
    zero, or not finite, gets 1)."""
    out = torch.ones_like(amax, dtype=torch.float32)
    for index, value in enumerate(amax.flatten().tolist()):
        if value > 0 and math.isfinite(value):
            out.view(-1)[index] = 2.0 ** math.ceil(math.log2(value * MARGIN / KV_FP8_MAX))
    return out


def kv_scales(model, config, model_path: str | None, tokenizer_path: str | None, device: torch.device,
              dtype: torch.dtype):
    """The FP8 pool's (k_scale, v_scale): the checkpoint's, else calibrated (module docstring)."""
    if model_path is not None:
        found = checkpoint_kv_scales(model_path, config.num_layers, config.num_kv_heads)
        if found is not None:
            log.info("fp8 kv scales from the checkpoint", k_max=found[0].max().item(), v_max=found[1].max().item())
            return found
    tokens = calibration_tokens(tokenizer_path, config.vocab_size)[:model.cos_sin_cache.shape[0]]  # rotary table
    k_scale, v_scale = calibrate_kv_scales(model, config, tokens, device, dtype)
    log.info("fp8 kv scales calibrated", tokens=len(tokens), k_max=k_scale.max().item(), v_max=v_scale.max().item())
    return k_scale, v_scale
