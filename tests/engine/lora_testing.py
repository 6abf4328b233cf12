"""PEFT adapters for the LoRA tests, made with peft itself on a tiny checkpoint.

PEFT starts B at zero (an adapter that changes nothing); ``make_peft_adapter`` draws B at
random so each adapter moves the outputs. Seeded, without disturbing the caller's RNG.

(A module of helpers with a unique name: tests/engine has no package.)
"""

from __future__ import annotations

import json
import os

import torch


def make_peft_adapter(base: str, out: str | os.PathLike, r: int, alpha: float,
                      targets: list[str] | str, seed: int = 0, b_std: float = 0.1, **options) -> str:
    """Save a PEFT LoRA adapter of ``base`` to ``out`` (``options``: more LoraConfig fields) -> ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = os.fspath(out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **options)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, b_std)
        peft_model.save_pretrained(out)
    return out


def edit_config(path: str, **changes) -> None:
    """Change fields of the adapter's adapter_config.json in place."""
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)
