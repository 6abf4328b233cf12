"""GGUF checkpoints: llama.cpp's one file of metadata, tokenizer and (mostly quantized) tensors.

The metadata becomes the config.json an HF checkpoint of the same model has in
``tandem.cluster.checkpoint.read_gguf_config`` (torch-free: the gateway reads it too). Here
the tensors are dequantized to the serving dtype with the gguf package's own numpy
dequantizers, renamed to the HF names the loader checks and fuses, and Llama's q/k rows
put back in HF's order: llama.cpp's convert_hf_to_gguf.py interleaves each head's two
rotary halves for Llama (its rope pairs adjacent dimensions, HF's pairs the halves) and
leaves Qwen2 as it is; transformers' own GGUF loader undoes the same permutation.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.cluster.checkpoint import GGUF_TENSOR_TYPES, CheckpointError, open_gguf, read_gguf_config

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    """The HF name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight");
    a name with no counterpart is kept, so the loader reports it as unexpected."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return name


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf.py's ``LlamaModel.permute`` on a q or k projection's rows:
    per head, llama.cpp's interleaved (x0, y0, x1, y1, ...) back to HF's halves (x..., y...)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_gguf_checkpoint(
    path: str, dtype: torch.dtype, device: torch.device
) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (config.json-shaped dict, HF-named tensors in ``dtype`` on ``device``)."""
    import gguf

    reader = open_gguf(path)
    raw = read_gguf_config(reader)
    llama = raw["architectures"] == ["LlamaForCausalLM"]
    heads = {"attn_q": raw["num_attention_heads"], "attn_k": raw["num_key_value_heads"]}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GGUF_TENSOR_TYPES:  # read_gguf_config refused these; kept explicit
            raise CheckpointError(f"unsupported GGUF tensor type {tensor.tensor_type.name} ({tensor.name})")
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not values.flags.writeable:  # a plain F32 tensor comes back as the read-only memory map itself
            values = values.copy()
        weight = torch.from_numpy(values)
        expected = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if tuple(weight.shape) != expected:
            weight = weight.reshape(expected)
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else ""
        if llama and kind in heads:
            weight = unpermute_rows(weight, heads[kind])
        tensors[hf_name(tensor.name)] = weight.to(dtype).to(device)  # cast on the host: a GPU never holds fp32 copies
    return raw, tensors
