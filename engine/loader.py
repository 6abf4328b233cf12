"""Load a Hugging Face safetensors checkpoint, or a GGUF file, into ``LlamaFamilyModel``.

Reads the tensors directly (no transformers model classes; a GGUF file's are
dequantized and renamed to HF's names by ``gguf_checkpoint``), checks the set of
names against what the config implies, and fuses q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj`` so each is one matmul at run time.

FP8 weights (``quantization="fp8"``, or an FP8 checkpoint, whose weights
``fp8_checkpoint`` reads): each decoder projection becomes E4M3 rows with one fp32
scale per output row, quantized from the checkpoint's own values (fused: per row of
the fused matrix, the same as per row of each part); embeddings, norms and lm_head
stay in the model dtype.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

from tandem.cluster.checkpoint import gguf_file
from tandem.engine.config import ModelConfig
from tandem.engine.fp8_checkpoint import read_fp8_weights
from tandem.engine.gguf_checkpoint import read_gguf_checkpoint
from tandem.engine.model import PROJECTIONS, LlamaFamilyModel
from tandem.engine.rope import build_cos_sin_cache
from tandem.engine.tensor_parallel import shard_config, shard_state
from tandem.kernels.fp8_weight import Fp8Weight, dequantize, fuse, quantize_weight

# Buffers some older checkpoints saved; recomputed by the engine, safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# KV-cache scales (compressed-tensors / vLLM, ModelOpt, the older kv_scale): not weights; an FP8
# KV cache reads them (engine.kv_scales)
KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale",
                     ".self_attn.k_proj.k_scale", ".self_attn.v_proj.v_scale")


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_position: int | None = None,
    max_attention_window: int | None = None,
    quantization: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[LlamaFamilyModel, ModelConfig]:
    """-> (model in eval mode without grads, config). The cos/sin cache covers
    ``max_position`` positions (default: the config's max_position_embeddings);
    ``max_attention_window`` caps every layer's attention span (sliding window);
    ``quantization`` "fp8" holds the projections as FP8 weights (an FP8 checkpoint always is;
    None or "none": as the checkpoint stores them). ``tp_rank`` of ``tp_size``: that rank's slice
    of the model, and the config of its shape (``engine.tensor_parallel``)."""
    if quantization not in (None, "none", "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}: none or fp8")
    path = os.fspath(path)
    device = torch.device(device)
    gguf_path = gguf_file(path)
    if gguf_path is not None:
        raw, tensors = read_gguf_checkpoint(gguf_path, dtype, device)
        config = ModelConfig.from_dict(raw)
    else:
        config = ModelConfig.from_pretrained(path)
        tensors = _read_safetensors(path, device)
    config.max_attention_window = max_attention_window
    if quantization == "fp8":
        config.quantization = "fp8"
    state = _to_engine_state(config, tensors, dtype)
    if tp_size > 1:
        state = shard_state(state, config, tp_rank, tp_size)
        config = shard_config(config, tp_size)
    with torch.device("meta"):
        model = LlamaFamilyModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.set_cos_sin_cache(build_cos_sin_cache(config, max_position or config.max_position_embeddings, device))
    model.requires_grad_(False)
    return model.eval(), config


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of the HF checkpoint in ``path``: those its index names, else
    model.safetensors, else every *.safetensors (a directory may hold other files too, such as
    Mistral's original-format consolidated.safetensors next to the HF shards)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (only safetensors checkpoints are supported)")
    return files


def _read_safetensors(path: str, device: torch.device) -> dict[str, torch.Tensor]:
    files = checkpoint_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        # load straight onto the target device: no host copy of a GPU model
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} appears in more than one safetensors file")
                tensors[name] = f.get_tensor(name)
    return tensors


def expected_hf_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{n}_proj.weight" for n in "qkvo"}
        if config.attention_bias:
            names |= {f"{p}self_attn.{n}_proj.bias" for n in "qkv"}
        names |= {f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    return names


def _to_engine_state(
    config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    tensors = {n: t for n, t in tensors.items() if not n.endswith(_IGNORED_SUFFIXES + KV_SCALE_SUFFIXES)}
    if config.checkpoint_fp8 is not None:
        tensors = read_fp8_weights(tensors, config.checkpoint_fp8)
    if config.tie_word_embeddings:
        # some tied checkpoints still store lm_head; HF ignores it, so do we
        tensors.pop("lm_head.weight", None)
    expected = expected_hf_names(config)
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {config.architecture} config: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )

    def get(name: str) -> torch.Tensor:
        tensor = tensors[name]
        return dequantize(tensor, dtype) if isinstance(tensor, Fp8Weight) else tensor.to(dtype)

    def projection(key: str, names: list[str]) -> None:
        """state[key + ".weight"] = the parts fused; with FP8 weights also key + ".weight_scale"."""
        if config.quantization != "fp8":
            state[key + ".weight"] = torch.cat([get(n) for n in names]) if len(names) > 1 else get(names[0])
            return
        parts = [t if isinstance(t, Fp8Weight) else quantize_weight(t) for t in (tensors.pop(n) for n in names)]
        state[key + ".weight"], state[key + ".weight_scale"] = fuse(parts) if len(parts) > 1 else parts[0]

    state = {"embed_tokens.weight": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head"] = get("lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        projection(ours + "qkv_proj", [f"{attn}{n}_proj.weight" for n in "qkv"])
        if config.attention_bias:
            state[ours + "qkv_proj.bias"] = torch.cat([get(f"{attn}{n}_proj.bias") for n in "qkv"])
        projection(ours + "o_proj", [attn + "o_proj.weight"])
        projection(ours + "gate_up_proj", [f"{hf}mlp.{n}_proj.weight" for n in ("gate", "up")])
        projection(ours + "down_proj", [hf + "mlp.down_proj.weight"])
        state[ours + "input_layernorm"] = get(hf + "input_layernorm.weight")
        state[ours + "post_attention_layernorm"] = get(hf + "post_attention_layernorm.weight")
    return state


def model_from_hf_state(
    config: ModelConfig,
    hf_state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    max_position: int | None = None,
) -> LlamaFamilyModel:
    """Our model from an HF-named state dict (e.g. ``LlamaForCausalLM.state_dict()``): same weights, fused."""
    device = torch.device(device)
    state = _to_engine_state(config, {n: t.to(device) for n, t in hf_state.items()}, dtype)
    with torch.device("meta"):
        model = LlamaFamilyModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.set_cos_sin_cache(build_cos_sin_cache(config, max_position or config.max_position_embeddings, device))
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def random_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    max_position: int | None = None,
    quantization: str | None = None,
) -> LlamaFamilyModel:
    """Random weights at the config's shapes, built on ``device`` (benchmarks: speed ignores values);
    ``quantization`` "fp8": the projections then quantized to FP8 weights, as ``load_model`` holds them."""
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaFamilyModel(config)
    model.to_empty(device=device)
    model.to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    for param in model.parameters():
        if param.dim() == 1:
            param.fill_(1.0)  # norm weights (and biases: harmless)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    if quantization == "fp8":
        config.quantization = "fp8"
        for layer in model.layers:
            for name in PROJECTIONS:
                proj = getattr(layer, name)
                fp8 = quantize_weight(proj.weight)
                proj.weight = nn.Parameter(fp8.data, requires_grad=False)
                proj.register_buffer("weight_scale", fp8.scale)
    model.set_cos_sin_cache(build_cos_sin_cache(config, max_position or config.max_position_embeddings, device))
    model.requires_grad_(False)
    return model.eval()
