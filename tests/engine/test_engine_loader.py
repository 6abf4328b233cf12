"""Config parsing, RoPE tables and the safetensors loader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tandem.engine.config import ModelConfig
from tandem.engine.loader import load_model
from tandem.engine.rope import build_cos_sin_cache

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_config_reads_both_rope_generations_and_eos_lists():
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}})
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}, "eos_token_id": 2},
        {"eos_token_id": [7, 2, 9]},
    )
    for cfg in (new, old):
        assert cfg.rope_theta == 5e5 and cfg.rope_type == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert old.eos_token_ids == [7, 2, 9] and new.eos_token_ids == []
    assert new.head_dim == 16 and new.num_kv_heads == 2 and new.sliding_window is None
    assert new.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert ModelConfig.from_dict({**BASE, "torch_dtype": "bfloat16"}).dtype == torch.bfloat16
    assert ModelConfig.from_dict(BASE).rope_scaling is None


def test_config_sliding_window_and_bias_per_architecture():
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    windowed = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert [windowed.layer_sliding_window(i) for i in range(2)] == [None, 4096]
    assert ModelConfig.from_dict(qwen).attention_bias
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 24})
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [24, 24]
    assert not mistral.attention_bias
    # keys left out mean transformers' class defaults (Mistral's window 4096; Qwen2's first windowed layer 28)
    assert ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"]}).sliding_window == 4096
    assert ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"],
                                  "sliding_window": None}).sliding_window is None
    deep = {**qwen, "use_sliding_window": True, "num_hidden_layers": 30}
    assert [ModelConfig.from_dict(deep).layer_sliding_window(i) for i in (27, 28)] == [None, 4096]
    assert ModelConfig.from_dict({**BASE, "hidden_act": "swish"}).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(
    "raw, match",
    [
        ({**BASE, "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type"),
        ({**BASE, "hidden_act": "gelu"}, "hidden_act"),
        ({**BASE, "attention_bias": True}, "o_proj then has a bias"),  # HF Llama's o_proj bias
        ({**BASE, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized checkpoints.*gptq"),
        ({**BASE, "quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                          "config_groups": {}}}, "quantized checkpoints.*int-quantized"),
    ],
)
def test_config_rejects_unsupported(raw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
    ],
)
def test_cos_sin_cache_matches_hf(rope):
    raw = {**BASE, "head_dim": 32, "rope_parameters": rope}
    hf = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    positions = torch.arange(256)[None]
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)  # [1, 256, head_dim], halves repeated
    cache = build_cos_sin_cache(ModelConfig.from_dict(raw), 256, "cpu")
    assert cache.shape == (256, 32) and cache.dtype == torch.float32
    torch.testing.assert_close(cache, torch.cat([cos[0, :, :16], sin[0, :, :16]], -1), atol=1e-6, rtol=0)


def test_fused_shapes_and_tied_embeddings(tiny_checkpoints):
    model, config = load_model(tiny_checkpoints["llama"])
    layer = model.layers[0]
    qkv_rows = (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
    assert layer.qkv_proj.weight.shape == (qkv_rows, config.hidden_size) and layer.qkv_proj.bias is None
    assert layer.gate_up_proj.weight.shape == (2 * config.intermediate_size, config.hidden_size)
    assert config.tie_word_embeddings and model.lm_head is None
    assert model.lm_head_weight.data_ptr() == model.embed_tokens.weight.data_ptr()

    hf = load_file(f"{tiny_checkpoints['llama']}/model.safetensors")
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(layer.qkv_proj.weight[: q.shape[0]], q, rtol=0, atol=0)
    torch.testing.assert_close(layer.qkv_proj.weight[q.shape[0] : q.shape[0] + k.shape[0]], k, rtol=0, atol=0)


def test_untied_with_bias_and_dtype_cast(tiny_checkpoints):
    model, config = load_model(tiny_checkpoints["qwen2"], dtype=torch.bfloat16)
    assert model.lm_head is not None and model.lm_head.dtype == torch.bfloat16
    assert model.layers[1].qkv_proj.bias.shape == ((config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim,)
    assert model.cos_sin_cache.dtype == torch.float32  # rotary math stays fp32
    assert not any(p.requires_grad for p in model.parameters())


def _copy_checkpoint(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_and_unexpected_tensors_are_named(tiny_checkpoints, tmp_path):
    path = _copy_checkpoint(tiny_checkpoints["mistral"], tmp_path / "ckpt")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*extra"):
        load_model(path)


def test_only_the_checkpoints_own_files_are_read(tiny_checkpoints, tmp_path):
    """Mistral's downloads hold an original-format consolidated.safetensors next to the HF
    weights: it is not read, whether the HF weights are one file or shards with an index."""
    path = _copy_checkpoint(tiny_checkpoints["mistral"], tmp_path / "ckpt")
    save_file({"layers.0.attention.wk.weight": torch.zeros(2)}, f"{path}/consolidated.safetensors")
    expected, _ = load_model(tiny_checkpoints["mistral"])
    single, _ = load_model(path)
    tensors = load_file(f"{path}/model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, f"{path}/{shard}")
    with open(f"{path}/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}, f)
    (tmp_path / "ckpt" / "model.safetensors").rename(tmp_path / "ckpt" / "stale.safetensors")  # not in the index
    sharded, _ = load_model(path)
    for model in (single, sharded):
        for (name, a), (_, b) in zip(expected.state_dict().items(), model.state_dict().items()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_unsupported_architecture_and_missing_weights(tiny_checkpoints, tmp_path):
    path = _copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "ckpt")
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**raw, "architectures": ["GPTNeoXForCausalLM"]}, f)
    with pytest.raises(ValueError, match="unsupported architecture.*GPTNeoXForCausalLM"):
        load_model(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(f"{tiny_checkpoints['llama']}/config.json", empty)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(empty)
