"""How much a model's logits move under FP8 weight rounding, against the same amount of random error.

    python3 -m tandem.bench.fp8_sensitivity [--shape llama3-8b] [--layers 1,2,4,8] [--default-model]
                                            [--out fp8_sensitivity.json]

For a random-weight model at a benchmark shape's width (its own depth replaced by --layers; the
vocabulary cut to 8192, the same for every depth), in fp32 with HF transformers on the CPU or a GPU:
the final logits' cosine similarity to the unquantized model over a 64-token prompt, with

  fp8:       every projection quantized per output channel to E4M3 and back (kernels.fp8_weight);
  shuffled:  the unquantized weights plus the same rounding errors, shuffled within each matrix
             (the same size of error, none of FP8's structure);
  noise_1e-3: each weight times (1 + 0.001 N(0, 1)), the scale of bf16's rounding.

Where fp8 and shuffled agree, the cosine is what the network makes of an error of that size, not
a property of the FP8 code; the drop per layer shows how it compounds with depth.
--default-model adds the same fp8 comparison on the default model's real weights (SmolLM2-135M-
Instruct from its GGUF file) and on random weights at its shape.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def _projections(model) -> list[torch.nn.Linear]:
    return [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]


def _cosine(model, ids) -> tuple[float, float]:
    """(min, mean) over the prompt's positions of the logits' cosine to ``model.reference``."""
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    cos = torch.nn.functional.cosine_similarity(logits, model.reference, dim=-1)
    return cos.min().item(), cos.mean().item()


def compare(model, ids, variants=("fp8", "shuffled", "noise_1e-3")) -> dict:
    """The variants' (min, mean) cosines and the FP8 weights' relative rounding error; restores the weights."""
    from tandem.kernels.fp8_weight import dequantize, quantize_weight

    with torch.inference_mode():
        model.reference = model(ids).logits[0].float()
    projs = _projections(model)
    original = [p.weight.data.clone() for p in projs]
    errors = [dequantize(quantize_weight(w)).to(w.dtype) - w for w in original]
    rel = (sum(e.float().pow(2).sum() for e in errors) / sum(w.float().pow(2).sum() for w in original)).sqrt()
    result = {"weight_rel_error": rel.item()}
    generator = torch.Generator(device=original[0].device).manual_seed(1)
    for variant in variants:
        for p, w, e in zip(projs, original, errors):
            if variant == "fp8":
                p.weight.data = w + e
            elif variant == "shuffled":
                order = torch.randperm(e.numel(), generator=generator, device=e.device)
                p.weight.data = w + e.flatten()[order].view_as(e)
            else:
                p.weight.data = w * (1 + 1e-3 * torch.randn(w.shape, generator=generator, device=w.device))
        result[variant] = _cosine(model, ids)
    for p, w in zip(projs, original):
        p.weight.data = w
    return result


def random_llama(shape: str, layers: int, device: str, vocab: int = 8192):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.bench.shapes import SHAPES

    s = SHAPES[shape]
    config = LlamaConfig(hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                         num_hidden_layers=layers, num_attention_heads=s["num_attention_heads"],
                         num_key_value_heads=s["num_key_value_heads"], vocab_size=vocab,
                         max_position_embeddings=1024, initializer_range=0.02)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--layers", default="1,2,4,8")
    parser.add_argument("--default-model", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="fp8_sensitivity.json")
    args = parser.parse_args()
    rows = []

    def show(label, r):
        rows.append({"model": label, **r})
        print(f"{label:<34} rel err {r['weight_rel_error']:.4f}  " + "  ".join(
            f"{k} {v[0]:.4f}/{v[1]:.4f}" for k, v in r.items() if isinstance(v, tuple)), flush=True)

    print("cosine to the unquantized logits, min/mean over 64 positions", flush=True)
    ids = torch.randint(3, 8192, (1, 64), generator=torch.Generator().manual_seed(0)).to(args.device)
    for layers in (int(n) for n in args.layers.split(",") if n):
        model = random_llama(args.shape, layers, args.device)
        show(f"{args.shape} width, {layers} layers, random", compare(model, ids))
        del model
    if args.default_model:
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        from tandem.models import default_gguf_file

        path = str(default_gguf_file())
        real = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).to(args.device).eval()
        ids = torch.randint(3, real.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
        ids = ids.to(args.device)
        show("SmolLM2-135M-Instruct, its weights", compare(real, ids, ("fp8", "shuffled")))
        torch.manual_seed(0)
        show("SmolLM2-135M shape, random", compare(LlamaForCausalLM(real.config).to(args.device).eval(), ids,
                                                  ("fp8", "shuffled")))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
