"""Tiny local checkpoints for tests (no downloads).

``make_tiny_checkpoint(path, arch)`` writes a random-weight HF checkpoint
(config.json, generation_config.json, model.safetensors) plus a byte-level BPE
tokenizer trained on a short built-in English text, with ``<pad>``=0,
``<s>``=1, ``</s>``=2 (eos, equal to the model's eos_token_id) and a chat
template. Weights are seeded, fp32, and initialised wider than HF's default
(std 0.1, not 0.02) so attention is far from uniform and RoPE or masking bugs
show up as large logit differences.
"""

from __future__ import annotations

import os
from typing import Any

import torch

TINY_VOCAB_SIZE = 512  # model vocab; the tokenizer's is a bit smaller (HF pads vocab the same way)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system answers many
requests at once: it reads the prompt, computes the keys and values of every
token, and then writes one new token at a time until the answer is complete.
Once upon a time there was a small model that lived in a test directory. It
had two layers, four heads and a tiny vocabulary, but it could still count:
one, two, three, four, five, six, seven, eight, nine, ten. Hello world! How are
you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France, and Berlin is the capital of Germany. The weather is nice
and the sun is shining; the children are playing in the park with their dogs.
Please write a short story about a robot who learns to paint. The robot looked
at the sky, mixed blue and white, and painted clouds over the quiet city.
"""

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    # llama: llama3 rope scaling whose three frequency bands all occur at head_dim 16, tied embeddings
    "llama": {
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": True,
    },
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},  # q/k/v biases always
    "mistral": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": 24},
}


def make_tiny_checkpoint(path: str | os.PathLike, arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random ``arch`` ("llama" | "qwen2" | "mistral") checkpoint + tokenizer to ``path``.

    ``overrides`` go to the transformers config class (e.g. num_hidden_layers=3).
    Returns ``path`` as a string.
    """
    from transformers import AutoModelForCausalLM

    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"unknown tiny arch {arch!r}: choose from {sorted(_ARCH_DEFAULTS)}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    config = _tiny_config(arch, max(TINY_VOCAB_SIZE, len(tokenizer)), overrides)
    with torch.random.fork_rng(devices=[]):  # seeded, without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # norm weights other than HF's all-ones default, so a mixed-up norm shows
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_tokenizer():
    """Byte-level BPE (~500 tokens) wrapped in a PreTrainedTokenizerFast; decode(encode(s)) == s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # no prefix space and no BOS post-processor: keeps decode(encode(s)) byte-exact
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<pad>", "<s>", "</s>"],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    assert (wrapped.pad_token_id, wrapped.bos_token_id, wrapped.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    return wrapped


def make_wordlevel_tokenizer(vocab_size: int):
    """A tokenizer covering every id of a large vocabulary (benchmarks on random weights):
    id i >= 3 is the word ``t{i}``, so every generated token streams as visible text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                      clean_up_tokenization_spaces=False)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _tiny_config(arch: str, vocab_size: int, overrides: dict[str, Any]):
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "initializer_range": 0.1, "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    }
    kwargs.update(_ARCH_DEFAULTS[arch])
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)
