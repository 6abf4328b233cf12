"""HF transformers anchors, measured in the same process as our engine.

Same approach as the anchors in the design notes: random weights at public
config shapes, bf16, on the same GPU: eager generate, static cache with the
forward compiled by generate, continuous batching (generate_batch), prefill.
"""

from __future__ import annotations

import time

import torch

from tandem.bench.shapes import SHAPES


def build_hf(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[name])
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval(), config


@torch.inference_mode()
def eager(model, config, batch: int, prompt_len: int, new_tokens: int) -> dict:
    ids = torch.randint(3, config.vocab_size, (batch, prompt_len), device="cuda")
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model(ids)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    n_new = out.shape[1] - prompt_len
    return {"prefill_ms": prefill_s * 1e3, "tpot_ms": (total_s - prefill_s) / max(n_new - 1, 1) * 1e3,
            "out_tok_per_s": batch * n_new / total_s}


@torch.inference_mode()
def static_compiled(model, config, batch: int, prompt_len: int, new_tokens: int) -> dict:
    ids = torch.randint(3, config.vocab_size, (batch, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    for _ in range(2):
        model.generate(ids, **kw)  # compile, then warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    n_new = out.shape[1] - prompt_len
    return {"out_tok_per_s": batch * n_new / total_s, "ms_per_token": total_s / n_new * 1e3}


@torch.inference_mode()
def prefill(model, config, prompt_len: int = 2048) -> dict:
    from tandem.bench.timing import median_ms

    ids = torch.randint(3, config.vocab_size, (1, prompt_len), device="cuda")
    return {"prefill_ms": median_ms(lambda: model(ids, logits_to_keep=1), reps=5, warmup=2)}


def continuous_batching(model, config, num_requests: int = 128, new_tokens: int = 256, seed: int = 0) -> dict:
    from transformers import GenerationConfig

    prompts = mixed_prompts(config.vocab_size, num_requests, seed)
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:4], generation_config=gen)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    n_out = sum(len(r.generated_tokens) for r in results.values())
    return {"out_tok_per_s": n_out / total_s, "total_s": total_s}


def mixed_prompts(vocab_size: int, num_requests: int = 128, seed: int = 0) -> list[list[int]]:
    """The mixed workload: prompt lengths uniform in [64, 511], seed 0."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(64, 512, (num_requests,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lens]
