"""Model configuration read from a Hugging Face checkpoint directory (or a GGUF file's metadata).

Only what the engine needs, normalised across transformers 4.x configs
(``rope_theta`` / ``rope_scaling`` / ``torch_dtype``) and 5.x configs
(``rope_parameters`` / ``dtype``), so nothing downstream has to care which
version wrote the checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.cluster.quantization import CheckpointFp8, checkpoint_fp8

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
HF_MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window when config.json leaves the key out
HF_QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2Config's max_window_layers likewise


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else the HF scaling dict with "rope_type" in ("linear", "llama3")
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    eos_token_ids: list[int]
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    # Per layer: whether sliding_window applies (Qwen2 windows only layers >= max_window_layers).
    sliding_window_layers: tuple[bool, ...] = field(default=())
    # --max-attention-window-size: every layer attends to at most this many tokens (a smaller own window wins)
    max_attention_window: int | None = None
    # "fp8": the decoder layers' projections are held as FP8 weights (kernels.fp8_weight), either
    # quantized at load (--quantization fp8) or read from an FP8 checkpoint (checkpoint_fp8)
    quantization: str | None = None
    checkpoint_fp8: CheckpointFp8 | None = None  # the checkpoint's own FP8 scheme (cluster.quantization)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        own = self.sliding_window
        if own is not None and self.sliding_window_layers and not self.sliding_window_layers[layer_idx]:
            own = None
        windows = [w for w in (own, self.max_attention_window) if w is not None]
        return min(windows) if windows else None

    def attention_window(self) -> int | None:
        """The window every layer's keys fit in (KV outside it can be dropped); None if a layer sees all."""
        windows = [self.layer_sliding_window(i) for i in range(self.num_layers)]
        return None if None in windows else max(windows)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        elem_size = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_size

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """From a checkpoint directory, or a GGUF file (or a directory holding one: its metadata)."""
        from tandem.cluster.checkpoint import gguf_file, read_model_config

        path = os.fspath(path)
        if gguf_file(path) is not None:
            return cls.from_dict(read_model_config(path))
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
        with open(config_file) as f:
            raw = json.load(f)
        gen_file = os.path.join(path, "generation_config.json")
        gen: dict[str, Any] = {}
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                gen = json.load(f)
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        arch = _architecture(raw)
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' names for the same function
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}: the engine implements SiLU MLPs only")
        if raw.get("mlp_bias", False):
            raise ValueError("unsupported mlp_bias=True: the engine's MLP has no biases")
        if arch == "LlamaForCausalLM" and raw.get("attention_bias", False):
            raise ValueError("unsupported attention_bias=True for Llama: its o_proj then has a bias too, which "
                             "the engine does not implement (Qwen2's q/k/v-only biases are supported)")
        fp8 = checkpoint_fp8(raw)  # an FP8 checkpoint's scheme; any other quantization: ValueError
        num_q_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        rope_theta, rope_scaling = _rope(raw)
        sliding_window, sliding_layers = _sliding_window(arch, raw, num_layers)
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=num_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_q_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_q_heads,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Mistral only when the flag says so (Llama's are refused above)
            attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            sliding_window=sliding_window,
            sliding_window_layers=sliding_layers,
            eos_token_ids=_eos_ids(raw, generation or {}),
            bos_token_id=(generation or {}).get("bos_token_id", raw.get("bos_token_id")),
            dtype=_dtype(raw.get("dtype") or raw.get("torch_dtype")),
            quantization="fp8" if fp8 is not None else None,
            checkpoint_fp8=fp8,
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPE_TO_ARCH:
        archs = [_MODEL_TYPE_TO_ARCH[raw["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(
        f"unsupported architecture {archs or raw.get('model_type')!r}: "
        f"the engine serves {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """-> (rope_theta, scaling dict or None). Accepts both config generations."""
    # transformers 5: everything in rope_parameters (per-layer-type dicts are not used by these models)
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}: supported are {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        missing = {"factor", "low_freq_factor", "high_freq_factor"} - scaling.keys()
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {sorted(missing)}")
    if "factor" not in scaling:
        raise ValueError(f"{rope_type} rope scaling has no 'factor'")
    return float(theta), {"rope_type": rope_type, **scaling}


def _sliding_window(arch: str, raw: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[bool, ...]]:
    # a key left out means transformers' class default: Mistral 4096 (an explicit null: no window)
    window = raw.get("sliding_window", HF_MISTRAL_WINDOW if arch == "MistralForCausalLM" else None)
    if arch == "LlamaForCausalLM" or window is None:
        return None, ()
    if arch == "Qwen2ForCausalLM":
        if not raw.get("use_sliding_window", False):
            return None, ()
        layer_types = raw.get("layer_types")
        if layer_types:
            windowed = tuple(t == "sliding_attention" for t in layer_types)
        else:
            first = raw.get("max_window_layers", HF_QWEN2_MAX_WINDOW_LAYERS)
            windowed = tuple(i >= first for i in range(num_layers))
        return (int(window), windowed) if any(windowed) else (None, ())
    return int(window), ()


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    # generation_config wins (Llama 3 instruct lists several stop ids only there)
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        for i in [source] if isinstance(source, int) else source or []:
            if i not in ids:
                ids.append(int(i))
    return ids


def _dtype(name: str | None) -> torch.dtype:
    if name is None:
        return torch.float32
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in config.json")
    return dtype
