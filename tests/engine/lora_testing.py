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


def peft_greedy_generator(base: str, adapters: dict[str, str]):
    """PeftModel over ``base`` with every adapter of ``adapters`` (name -> directory), fp32 on the
    CPU -> generate(adapter or None, prompt ids, n, ignore_eos=False): greedy tokens. generate()
    stops at EOS; with ``ignore_eos`` the tokens go on past it, as the server's do."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)

    def generate(adapter: str | None, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False):
        with torch.inference_mode():
            if ignore_eos:
                model.set_adapter(adapter)
                ids = list(prompt_ids)
                for _ in range(max_new_tokens):
                    ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                return ids[len(prompt_ids):]
            kwargs = dict(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            else:
                model.set_adapter(adapter)
                out = model.generate(**kwargs)
        return out[0, len(prompt_ids):].tolist()

    return generate
