"""The tiny-checkpoint helper other packages' tests rely on."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tandem.engine.attention import SeqChunk
from tandem.engine.config import ModelConfig
from tandem.engine.kv_cache import KVCachePool
from tandem.engine.runner import ModelRunner
from tandem.engine.demo_model import EOS_ID, make_tiny_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tokenizer_round_trips_and_matches_model(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    tok = AutoTokenizer.from_pretrained(path)
    config = ModelConfig.from_pretrained(path)
    assert tok.eos_token_id == EOS_ID and config.eos_token_ids == [EOS_ID]
    assert len(tok) <= config.vocab_size
    for text in ["Hello world!", "  two leading spaces, ünïcødé and 日本語\n\ttab", ""]:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>\nhi</s>\n<|assistant|>\n"
    assert EOS_ID in tok.encode(prompt)  # "</s>" in the template is the eos token, not its characters


def test_checkpoint_is_seeded(tiny_checkpoints, tmp_path):
    again = load_file(f"{make_tiny_checkpoint(tmp_path / 'again', 'qwen2')}/model.safetensors")
    first = load_file(f"{tiny_checkpoints['qwen2']}/model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = load_file(f"{make_tiny_checkpoint(tmp_path / 'other', 'qwen2', seed=1)}/model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_overrides_reach_the_config(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "deep", "llama", num_hidden_layers=3, tie_word_embeddings=False)
    config = ModelConfig.from_pretrained(path)
    assert config.num_layers == 3 and not config.tie_word_embeddings and config.rope_type == "llama3"


def test_runner_rejects_a_pool_that_does_not_fit(tiny_checkpoints):
    pool = KVCachePool(2, 8, 4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        ModelRunner(tiny_checkpoints["llama"], num_blocks=8, block_size=4, kv_pool=pool)
    runner = ModelRunner(tiny_checkpoints["llama"], num_blocks=200, block_size=4)
    with pytest.raises(ValueError, match="at least one sequence"):
        runner.forward([])
    with pytest.raises(ValueError, match="rotary table"):
        runner.forward([SeqChunk([1], runner.max_position, list(range(200)))])
