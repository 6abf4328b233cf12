"""Random PEFT LoRA adapters for a model shape, written as the directories users serve
(``adapter_config.json`` + ``adapter_model.safetensors``), for the LoRA benchmarks: their
weights are random (a benchmark times them; it does not read their answers)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tandem.engine.config import ModelConfig
from tandem.engine.lora_adapter import target_shapes

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(config: ModelConfig, path: str, rank: int = 16, seed: int = 0,
                         targets: tuple[str, ...] = ALL_TARGETS) -> str:
    """A rank-``rank`` adapter on ``targets`` of every layer, at ``path`` (made if missing) -> path."""
    gen = torch.Generator().manual_seed(seed)
    shapes = target_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for target in targets:
            in_features, out_features = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[target]}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_features, generator=gen)
                                                  / in_features**0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=gen)
                                                  * 0.01).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                   "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return path


def write_random_adapters(config: ModelConfig, directory: str, count: int, rank: int = 16) -> dict[str, str]:
    """``count`` adapters named lora-0 .. lora-<count-1> under ``directory`` -> name: path."""
    return {f"lora-{i}": write_random_adapter(config, os.path.join(directory, f"lora-{i}"), rank, seed=i)
            for i in range(count)}
