"""GGUF checkpoints: metadata -> config, each tensor type's dequantization, names, llama's q/k order.

The GGUF files are written here with gguf's own writer from the tiny random HF checkpoints,
the way llama.cpp's convert_hf_to_gguf.py writes them (its tensor names, its q/k row
permutation for Llama only, the output projection left out when tied).
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tandem.cluster.checkpoint import GGUF_TENSOR_TYPES, CheckpointError, gguf_file, read_model_config
from tandem.engine.config import ModelConfig
from tandem.engine.demo_model import make_tiny_checkpoint
from tandem.engine.gguf_checkpoint import read_gguf_checkpoint
from tandem.engine.loader import load_model
from tandem.engine.runner import ModelRunner
from tests.engine.test_engine_parity import _make_seqs, _run_engine

Q = gguf.GGMLQuantizationType
# float32-exact, so config.json's value and the GGUF file's float32 are the same number
RMS_EPS = 2.0**-20
# the HF -> GGUF names of convert_hf_to_gguf.py (written out here, not taken from the code under test)
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# where each K-quant block keeps its fp16 scales (ggml-common.h): random bytes there would be
# inf/nan, so those get small finite values and every other byte stays random
K_QUANT_F16_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[module]}.{suffix}"


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def encode(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """``values`` in ``qtype``: gguf's quantizer where it has one, else random blocks of the type."""
    try:
        return gguf.quants.quantize(values, Q[qtype])
    except NotImplementedError:  # gguf's numpy code has no K-quant quantizers
        block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
        rows, cols = values.shape
        raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        for offset in K_QUANT_F16_OFFSETS[qtype]:
            scales = rng.uniform(1e-3, 1e-2, len(raw)).astype(np.float16)
            raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
        return raw.reshape(rows, -1)


def write_gguf(path, checkpoint: str, arch: str, qtype: str = "F32", seed: int = 0, **metadata) -> str:
    """The HF checkpoint as llama.cpp would convert it: 2-D weights in ``qtype``, norms in F32."""
    with open(f"{checkpoint}/config.json") as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    if cfg["head_dim"] != cfg["hidden_size"] // heads:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for key, value in metadata.items():
        writer.add_key_value(key, value[0], value[1])
    for name, tensor in sorted(load_file(f"{checkpoint}/model.safetensors").items()):
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(data, heads, heads if ".q_proj." in name else kv_heads)
        tensor_type = qtype if data.ndim == 2 else "F32"
        writer.add_tensor(gguf_name(name), encode(data, tensor_type, rng), raw_dtype=Q[tensor_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def plain_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny Llama (tied, permuted in GGUF) and Qwen2 (q/k/v biases), default rope."""
    root = tmp_path_factory.mktemp("gguf-hf")
    llama = make_tiny_checkpoint(root / "llama", "llama", rms_norm_eps=RMS_EPS,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    qwen2 = make_tiny_checkpoint(root / "qwen2", "qwen2", rms_norm_eps=RMS_EPS)
    return {"llama": llama, "qwen2": qwen2}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> str:
    """Rows of 256 values (hidden, q heads * head_dim and intermediate): a whole K-quant block."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gguf-wide"), "llama", hidden_size=256,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                                num_hidden_layers=1, tie_word_embeddings=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_gives_the_same_config_and_logits_as_safetensors(plain_checkpoints, tmp_path, arch):
    checkpoint = plain_checkpoints[arch]
    path = write_gguf(tmp_path / f"{arch}.gguf", checkpoint, arch)
    assert ModelConfig.from_pretrained(path) == ModelConfig.from_pretrained(checkpoint)
    expected = ModelRunner(checkpoint, num_blocks=64, block_size=4)
    runner = ModelRunner(path, num_blocks=64, block_size=4)
    for (name, a), (_, b) in zip(expected.model.state_dict().items(), runner.model.state_dict().items()):
        assert torch.equal(a, b), name
    for model in (expected.model, runner.model):
        for param in model.parameters():
            # fresh allocations: a safetensors tensor can sit at any 8-byte offset of its memory map,
            # and the CPU matmul's rounding depends on its operands' alignment
            param.data = param.data.clone()
    seqs, ours = (_make_seqs(expected.config.vocab_size, 64, 4) for _ in range(2))
    _run_engine(expected, seqs)
    _run_engine(runner, ours)
    for a, b in zip(seqs, ours):
        assert a.tokens == b.tokens
        assert all(torch.equal(a.logits[p], b.logits[p]) for p in a.logits)


def test_llama_q_k_left_in_gguf_order_would_show(plain_checkpoints, tmp_path, monkeypatch):
    """The permutation matters to the logits: without undoing it the model is another one."""
    from tandem.engine import gguf_checkpoint

    checkpoint = plain_checkpoints["llama"]
    path = write_gguf(tmp_path / "llama.gguf", checkpoint, "llama")
    monkeypatch.setattr(gguf_checkpoint, "unpermute_rows", lambda weight, _heads: weight)
    model, _ = load_model(path)
    expected, _ = load_model(checkpoint)
    assert not torch.equal(model.layers[0].qkv_proj.weight, expected.layers[0].qkv_proj.weight)
    assert torch.equal(model.layers[0].o_proj.weight, expected.layers[0].o_proj.weight)


@pytest.mark.parametrize("qtype", GGUF_TENSOR_TYPES)
def test_each_tensor_type_is_gguf_own_dequantization(wide_llama, tmp_path, qtype):
    path = write_gguf(tmp_path / f"{qtype}.gguf", wide_llama, "llama", qtype)
    raw, tensors = read_gguf_checkpoint(path, torch.float32, torch.device("cpu"))
    heads = {"attn_q": raw["num_attention_heads"], "attn_k": raw["num_key_value_heads"]}
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {qtype}
    hf_names = {gguf_name(n): n for n in load_file(f"{wide_llama}/model.safetensors")}
    assert sorted(tensors) == sorted(hf_names[t.name] for t in reader.tensors)
    for t in reader.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        ours = tensors[hf_names[t.name]].numpy()
        kind = t.name.split(".")[-2]
        if kind in heads:  # ours is in HF's order: put it back in the file's to compare
            ours = llama_cpp_permute(ours, raw["num_attention_heads"], heads[kind])
        assert ours.shape == want.shape and np.isfinite(want).all(), t.name
        np.testing.assert_array_equal(ours, want, err_msg=t.name)


def test_quantized_weights_in_the_serving_dtype(wide_llama, tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", wide_llama, "llama", "Q8_0")
    model, config = load_model(path, dtype=torch.bfloat16)
    assert model.layers[0].qkv_proj.weight.dtype == torch.bfloat16 and model.norm.dtype == torch.bfloat16
    assert not config.tie_word_embeddings and model.lm_head is not None
    reference, _ = load_model(wide_llama)
    # Q8_0 keeps a weight to within half a step of its block's scale (max |w| / 127)
    diff = (model.layers[0].gate_up_proj.weight.float() - reference.layers[0].gate_up_proj.weight).abs().max()
    assert 0 < diff < 0.02


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_gguf_matches_transformers_own_gguf_load(plain_checkpoints, tmp_path, arch):
    """transformers' GGUF loader undoes llama.cpp's layout by its own code: same logits."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / f"{arch}.gguf", plain_checkpoints[arch], arch, "Q8_0")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf", dtype=torch.float32).eval()
    runner = ModelRunner(path, num_blocks=64, block_size=4)
    seqs = _make_seqs(runner.config.vocab_size, 64, 4)
    _run_engine(runner, seqs)
    with torch.no_grad():
        for seq in seqs:
            ref = hf(torch.tensor([seq.tokens])).logits[0]
            for pos, row in seq.logits.items():
                torch.testing.assert_close(row, ref[pos], atol=1e-4, rtol=0)


def test_gguf_paths_and_refusals(plain_checkpoints, tmp_path):
    (tmp_path / "one").mkdir()
    path = write_gguf(tmp_path / "one" / "model.gguf", plain_checkpoints["qwen2"], "qwen2")
    assert gguf_file(str(tmp_path / "one")) == path and gguf_file(path) == path
    assert gguf_file(plain_checkpoints["qwen2"]) is None  # an HF checkpoint directory
    assert read_model_config(str(tmp_path / "one"))["architectures"] == ["Qwen2ForCausalLM"]
    write_gguf(tmp_path / "one" / "other.gguf", plain_checkpoints["qwen2"], "qwen2")
    with pytest.raises(CheckpointError, match="holds 2 .gguf files"):
        read_model_config(str(tmp_path / "one"))

    cases = [
        ({"general.architecture": ("gpt2", gguf.GGUFValueType.STRING)}, "unsupported GGUF architecture 'gpt2'"),
        ({"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}, "unsupported GGUF rope scaling 'yarn'"),
        ({"llama.expert_count": (8, gguf.GGUFValueType.UINT32)}, "mixture-of-experts"),
    ]
    for i, (metadata, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}.gguf"
        arch = metadata.pop("general.architecture", ("llama",))[0]
        write_gguf(bad, plain_checkpoints["llama"], arch, **metadata)
        with pytest.raises(ValueError, match=message):
            load_model(str(bad))


def test_unsupported_tensor_type_refused_by_the_cli_in_one_line(plain_checkpoints, tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32 // 32 * 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    done = subprocess.run([sys.executable, "-m", "tandem", "serve", "--model", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "serving" not in done.stdout
    assert done.stderr.strip().splitlines() == [
        f"tandem: unsupported GGUF tensor type IQ4_NL: tandem dequantizes {', '.join(GGUF_TENSOR_TYPES)}"]


def test_gguf_metadata_is_read_without_torch(plain_checkpoints, tmp_path):
    """The gateway (torch-free) reads a GGUF checkpoint's limits through read_model_config."""
    path = write_gguf(tmp_path / "qwen2.gguf", plain_checkpoints["qwen2"], "qwen2")
    code = ("import sys; from tandem.cluster.settings import Settings; s = Settings(model=sys.argv[1]).resolve(); "
            "print(s.max_seq_len, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["512", "False"], done.stderr
