"""Checkpoints as the cluster reads them, torch-free: a model's config.json, or the same keys
from a GGUF file's metadata.

The gateway needs a model's limits (context, vocabulary) without torch, and the CLI should
refuse what the engine cannot serve (an architecture, a tensor type, a split file, experts,
rope factors) in one line before any worker starts; so the readers live here, below every
layer. ``tandem.engine.gguf_checkpoint`` dequantizes a GGUF file's tensors, and
``tandem.engine.loader`` loads safetensors; both start from these readers.
"""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint the engine cannot serve, or cannot read; the message says which and why."""


def read_model_config(model: str) -> dict:
    """The checkpoint's config.json as a dict; for a GGUF checkpoint, the same keys from its metadata."""
    gguf_path = gguf_file(model)
    if gguf_path is not None:
        return read_gguf_config(open_gguf(gguf_path))
    path = Path(model) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in model directory {model!r} (nor a .gguf file)")
    return json.loads(path.read_text())


# GGUF checkpoints (llama.cpp's one file of metadata, tokenizer and tensors); engine/gguf_checkpoint.py
# dequantizes the tensors. llama.cpp's architecture name -> the HF one the engine implements:
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# the tensor types dequantized at load (with the gguf package's own numpy dequantizers)
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_REQUIRED = object()


def gguf_file(model: str) -> str | None:
    """The GGUF file ``model`` names: the .gguf file itself, or the one .gguf file of a directory
    without a config.json; None for anything else (an HF checkpoint directory)."""
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return str(path)
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(f"{model!r} holds {len(files)} .gguf files: pass the one to serve as --model")
    return str(files[0]) if files else None


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` over the file (memory-mapped: tensors are read when touched)."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("GGUF checkpoints need the gguf package: pip install 'gguf>=0.10'") from None
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError) as exc:  # KeyError/ValueError: a type or magic it does not know
        raise CheckpointError(f"cannot read the GGUF file {path!r}: {exc}") from None


def read_gguf_config(reader) -> dict:
    """The config.json an HF checkpoint of the same model has (the keys the engine reads), from
    a GGUF file's metadata; what the engine would serve wrongly is refused, in one line."""
    import gguf

    def value(key: str, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise CheckpointError(f"GGUF metadata has no {key!r}")
            return default
        part = field.parts[field.data[0]]
        return bytes(part).decode() if field.types[0] == gguf.GGUFValueType.STRING else part[0].item()

    arch = value("general.architecture", _REQUIRED)
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"unsupported GGUF architecture {arch!r}: tandem serves {', '.join(GGUF_ARCHITECTURES)}")
    types = sorted({t.tensor_type.name for t in reader.tensors} - set(GGUF_TENSOR_TYPES))
    if types:
        raise CheckpointError(f"unsupported GGUF tensor type {', '.join(types)}: tandem dequantizes "
                            f"{', '.join(GGUF_TENSOR_TYPES)}")
    if value("split.count", 1) > 1:
        raise CheckpointError("a split GGUF checkpoint: merge its files first (llama-gguf-split --merge)")
    if value(f"{arch}.expert_count", 0):
        raise CheckpointError(f"a mixture-of-experts GGUF checkpoint ({arch}.expert_count): the engine's MLP is dense")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # llama.cpp's form of Llama 3.1's rope scaling: per-frequency factors
        raise CheckpointError("GGUF rope frequency factors (rope_freqs.weight, Llama 3.1 rope scaling) are not supported")
    hidden, heads = value(f"{arch}.embedding_length", _REQUIRED), value(f"{arch}.attention.head_count", _REQUIRED)
    head_dim = value(f"{arch}.attention.key_length", hidden // heads)
    if value(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"GGUF {arch}.rope.dimension_count differs from the head size {head_dim}: "
                            "partial rotary embeddings are not supported")
    rope_type = value(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise CheckpointError(f"unsupported GGUF rope scaling {rope_type!r}: supported are none and linear")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab_size is None:
        raise CheckpointError(f"GGUF metadata has neither {arch}.vocab_size nor a token list")
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": value(f"{arch}.block_count", _REQUIRED),
        "num_attention_heads": heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": value(f"{arch}.feed_forward_length", _REQUIRED),
        "rms_norm_eps": value(f"{arch}.attention.layer_norm_rms_epsilon", _REQUIRED),
        "rope_theta": value(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": ({"rope_type": "linear", "factor": value(f"{arch}.rope.scaling.factor", _REQUIRED)}
                         if rope_type == "linear" else None),
        "max_position_embeddings": value(f"{arch}.context_length", _REQUIRED),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": value("tokenizer.ggml.eos_token_id"),
        "bos_token_id": value("tokenizer.ggml.bos_token_id"),
    }
