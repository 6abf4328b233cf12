"""FP8 weights at load: `--quantization fp8` on bf16/fp32 checkpoints, and FP8 checkpoints read as
they are: compressed-tensors (per channel, per tensor) and transformers' fp8 (128x128-style block
scales, here 16x24 blocks, ragged at the edges). Each is a tiny random Llama whose safetensors
and config.json are rewritten into the format; the engine (CPU, fp32 activations: FP8 weights
dequantized then multiplied) must match HF transformers on the weights the engine holds,
dequantized, as closely as the unquantized engine matches HF (test_engine_parity). Every other
quantized checkpoint is refused in one line, by the engine and by the CLI's settings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_parity import TOLERANCE, _hf, _make_seqs, _max_diff_vs_hf, _run_engine

from tandem.cluster.settings import Settings, SettingsError
from tandem.engine.config import ModelConfig
from tandem.engine.loader import load_model
from tandem.engine.runner import ModelRunner
from tandem.kernels.fp8_weight import FP8_DTYPE, FP8_MAX, Fp8Weight, dequantize, quantize_weight

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
BLOCK = (16, 24)  # transformers' fp8 weight_block_size here: 64-wide K is 3 ragged blocks
UNQUANTIZED = "model.layers.1.mlp.down_proj"  # left in fp32 by the FP8 formats (their ignore lists)


def _projections(tensors: dict) -> list[str]:
    return sorted(n.removesuffix(".weight") for n in tensors if n.endswith(".weight") and n.split(".")[-2] in
                  {p.split(".")[1] for p in PROJECTIONS})


def _channel(w):
    q = quantize_weight(w)
    return q.data, q.scale[:, None]


def _tensor(w):
    scale = w.abs().max().float() / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(1)


def _blocks(w):
    (bn, bk), (N, K) = BLOCK, w.shape
    padded = torch.zeros(-(-N // bn) * bn, -(-K // bk) * bk)
    padded[:N, :K] = w
    amax = padded.reshape(padded.shape[0] // bn, bn, -1, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    expanded = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _ct_config(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head", UNQUANTIZED]}


FORMATS = {
    # name: (quantize one weight, its scale's name, quantization_config, scale dtype)
    "ct_channel": (_channel, "weight_scale", _ct_config("channel"), torch.bfloat16),  # llm-compressor's scale dtype
    "ct_tensor": (_tensor, "weight_scale", _ct_config("tensor"), torch.float32),
    "hf_fp8_blocks": (_blocks, "weight_scale_inv", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                     "weight_block_size": list(BLOCK),
                                                     "modules_to_not_convert": [UNQUANTIZED]}, torch.float32),
}


def _rewrite(src: str, dst: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Copy the checkpoint in ``src`` to ``dst`` in format ``fmt``; -> HF-named fp32 weights equal to
    what the FP8 checkpoint stores (dequantized), for the reference model."""
    quantize, scale_name, qconfig, scale_dtype = FORMATS[fmt]
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    truth = dict(tensors)
    for name in _projections(tensors):
        if name == UNQUANTIZED:
            continue
        data, scale = quantize(tensors.pop(name + ".weight"))
        scale = scale.to(scale_dtype)
        tensors[name + ".weight"], tensors[f"{name}.{scale_name}"] = data, scale
        if fmt.startswith("ct"):
            tensors[name + ".input_scale"] = torch.ones(1)  # a static activation scale: not used
        n, k = data.shape
        expanded = (scale.float().repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
                    if fmt == "hf_fp8_blocks" else scale.float().reshape(-1, 1))
        truth[name + ".weight"] = data.float() * expanded
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    return truth


def _engine_weights_as_hf(model) -> dict[str, torch.Tensor]:
    """The engine's projection weights, dequantized, under HF's names (q/k/v and gate/up split)."""
    out = {}
    config = model.config
    q, kv = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i, layer in enumerate(model.layers):
        def dense(proj):
            assert proj.weight.dtype == FP8_DTYPE and proj.weight_scale.dtype == torch.float32
            return dequantize(Fp8Weight(proj.weight, proj.weight_scale))

        p = f"model.layers.{i}."
        for name, part in zip("qkv", dense(layer.qkv_proj).split([q, kv, kv])):
            out[f"{p}self_attn.{name}_proj.weight"] = part
        out[p + "self_attn.o_proj.weight"] = dense(layer.o_proj)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = dense(layer.gate_up_proj).chunk(2)
        out[p + "mlp.down_proj.weight"] = dense(layer.down_proj)
    return out


def _parity(path: str, hf_weights: dict[str, torch.Tensor], quantization: str | None) -> float:
    """The engine (FP8 weights, CPU) against HF with ``hf_weights`` put in: the largest logit difference."""
    runner = ModelRunner(path, num_blocks=64, block_size=8, quantization=quantization)
    seqs = _make_seqs(runner.config.vocab_size, 64, 8)
    assert _run_engine(runner, seqs) == {"prefill", "mixed", "decode"}
    hf = _hf(path) if quantization else _hf_unquantized(path)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name in hf_weights:
                param.copy_(hf_weights[name])
            else:
                assert quantization, f"{name}: no weight for HF's model"  # built from its config: set them all
    return _max_diff_vs_hf(hf, seqs)


def _hf_unquantized(path: str):
    """HF's model of an FP8 checkpoint's architecture (its weights are set by the caller)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_quantization_fp8_quantizes_every_projection_per_output_channel(tiny_checkpoints, tmp_path, source_dtype):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["qwen2"], path)  # q/k/v biases: they stay in the model dtype
    tensors = {n: t.to(source_dtype) for n, t in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")
    model, config = load_model(path, quantization="fp8")
    assert config.quantization == "fp8"
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        proj = getattr(model.layers[0], name)
        assert proj.weight.dtype == FP8_DTYPE and proj.weight_scale.shape == (proj.weight.shape[0],)
    assert model.layers[0].qkv_proj.bias.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == model.lm_head.dtype == model.norm.dtype == torch.float32
    # fused q/k/v: exactly each part quantized per row (the scales are the parts' own)
    p = "model.layers.0.self_attn."
    expected = [quantize_weight(tensors[f"{p}{n}_proj.weight"]) for n in "qkv"]
    assert torch.equal(model.layers[0].qkv_proj.weight_scale, torch.cat([e.scale for e in expected]))
    assert torch.equal(model.layers[0].qkv_proj.weight.view(torch.uint8),
                       torch.cat([e.data for e in expected]).view(torch.uint8))
    assert _parity(str(path), _engine_weights_as_hf(model), "fp8") <= TOLERANCE


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_checkpoints_load_as_per_channel_fp8_weights(tiny_checkpoints, tmp_path, fmt):
    path = tmp_path / fmt
    truth = _rewrite(tiny_checkpoints["llama"], path, fmt)
    model, config = load_model(path)  # FP8 without --quantization: the checkpoint says so
    assert config.quantization == "fp8" and config.checkpoint_fp8.method == FORMATS[fmt][2]["quant_method"]
    held = _engine_weights_as_hf(model)
    for name, weight in truth.items():
        if name not in held:
            continue
        if fmt == "hf_fp8_blocks" or name.startswith(UNQUANTIZED):
            # re-quantized per row (blocks: from their dequantized values; the fp32 layer: at load)
            expected = dequantize(quantize_weight(weight))
        else:
            expected = weight  # per channel and per tensor: the checkpoint's own values, exactly
        assert torch.equal(held[name], expected), name
    assert _parity(str(path), {**truth, **held}, None) <= TOLERANCE  # embeddings, norms: the checkpoint's


def test_block_scales_requantized_per_row_stay_close_to_the_checkpoint(tiny_checkpoints, tmp_path):
    truth = _rewrite(tiny_checkpoints["llama"], tmp_path / "blocks", "hf_fp8_blocks")
    held = _engine_weights_as_hf(load_model(tmp_path / "blocks")[0])
    for name in truth.keys() & held.keys():
        w = truth[name]
        assert (held[name] - w).abs().max() <= w.abs().amax(1, keepdim=True).max() / 16, name


def test_a_fused_projection_mixing_fp8_and_unquantized_parts(tiny_checkpoints, tmp_path):
    """A checkpoint that left only v_proj unquantized: the fused q/k/v still has one scale per row."""
    truth = _rewrite(tiny_checkpoints["llama"], tmp_path / "mixed", "ct_channel")
    tensors = load_file(tmp_path / "mixed" / "model.safetensors")
    v = "model.layers.0.self_attn.v_proj"
    tensors[v + ".weight"] = truth[v + ".weight"]
    del tensors[v + ".weight_scale"], tensors[v + ".input_scale"]
    save_file(tensors, tmp_path / "mixed" / "model.safetensors")
    held = _engine_weights_as_hf(load_model(tmp_path / "mixed")[0])
    assert torch.equal(held[v + ".weight"], dequantize(quantize_weight(truth[v + ".weight"])))
    assert torch.equal(held["model.layers.0.self_attn.q_proj.weight"], truth["model.layers.0.self_attn.q_proj.weight"])


def test_a_scale_without_its_weight_or_a_float8_weight_without_a_scale_is_refused(tiny_checkpoints, tmp_path):
    _rewrite(tiny_checkpoints["llama"], tmp_path / "bad", "ct_channel")
    tensors = load_file(tmp_path / "bad" / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight.*has no weight_scale"):
        load_model(tmp_path / "bad")


REFUSED = [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method='gptq'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}}, "int-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
    ({**_ct_config("channel"), "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int",
                                                                         "strategy": "channel"}}}}, "8-bit int"),
    ({**_ct_config("channel"), "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                                         "strategy": "group"}}}}, "group"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
]


@pytest.mark.parametrize("qconfig, detail", REFUSED)
def test_other_quantized_checkpoints_are_refused_in_one_line(tiny_checkpoints, tmp_path, qconfig, detail):
    path = tmp_path / "q"
    shutil.copytree(tiny_checkpoints["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as engine_error:
        ModelConfig.from_pretrained(path)
    with pytest.raises(SettingsError) as settings_error:
        Settings(model=str(path)).resolve()
    for error in (engine_error, settings_error):
        message = str(error.value)
        assert message.startswith("quantized checkpoints (") and detail in message and "\n" not in message
        assert "not supported" in message
