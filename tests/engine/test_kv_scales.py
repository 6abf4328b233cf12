"""Where an FP8 KV cache's scales come from: the checkpoint's k_scale/v_scale when it has them (in
any of the names the engines write), else one calibration forward, the same in every process."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engine.demo_model import make_tiny_checkpoint
from tandem.engine.kv_scales import MARGIN, calibration_tokens, power_of_two_scales
from tandem.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")  # 2 layers, 2 KV heads


def _with_scales(tiny: str, tmp_path, names: dict[str, torch.Tensor]) -> str:
    path = tmp_path / "scaled"
    shutil.copytree(tiny, path)
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, **names}, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.mark.parametrize("style", ["compressed-tensors", "modelopt", "kv_scale", "per head"])
def test_the_checkpoints_scales_are_taken_as_given(tiny, tmp_path, style):
    names = {}
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        k, v = torch.tensor(0.0123 * (layer + 1)), torch.tensor(0.002 * (layer + 1))
        if style == "compressed-tensors":
            names |= {p + "k_scale": k, p + "v_scale": v}
        elif style == "modelopt":
            names |= {p + "k_proj.k_scale": k.reshape(1), p + "v_proj.v_scale": v.reshape(1)}
        elif style == "kv_scale":
            names |= {p + "kv_scale": k}
        else:
            names |= {p + "k_scale": k * torch.tensor([1.0, 2.0]), p + "v_scale": v * torch.tensor([1.0, 2.0])}
    path = _with_scales(tiny, tmp_path, names)
    runner = ModelRunner(path, num_blocks=8, block_size=4, kv_cache_dtype="fp8")
    expected_k = torch.tensor([[0.0123, 0.0123], [0.0246, 0.0246]])
    expected_v = expected_k if style == "kv_scale" else torch.tensor([[0.002, 0.002], [0.004, 0.004]])
    if style == "per head":
        expected_k, expected_v = expected_k * torch.tensor([1.0, 2.0]), expected_v * torch.tensor([1.0, 2.0])
    torch.testing.assert_close(runner.kv_pool.k_scale, expected_k)
    torch.testing.assert_close(runner.kv_pool.v_scale, expected_v)
    # the weights load as without the scales, and a dense cache ignores them
    dense = ModelRunner(path, num_blocks=8, block_size=4)
    assert dense.kv_pool.k_scale is None


def test_scales_of_some_layers_only_are_refused(tiny, tmp_path):
    path = _with_scales(tiny, tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(0.1),
                                         "model.layers.0.self_attn.v_scale": torch.tensor(0.1)})
    with pytest.raises(ValueError, match="leave out layer 1"):
        ModelRunner(path, num_blocks=8, block_size=4, kv_cache_dtype="fp8")


def test_calibration_is_the_same_in_every_runner_and_a_power_of_two(tiny):
    a, b = (ModelRunner(tiny, num_blocks=8, block_size=4, kv_cache_dtype="fp8") for _ in range(2))
    assert a.kv_pool.kv_format() == b.kv_pool.kv_format()
    for scale in (a.kv_pool.k_scale, a.kv_pool.v_scale):
        assert torch.equal(scale, 2 ** scale.log2().round())
    tokens = calibration_tokens(tiny, a.config.vocab_size)
    assert 100 < len(tokens) <= 512 and tokens == calibration_tokens(tiny, a.config.vocab_size)
    assert calibration_tokens(None, 50) == calibration_tokens("/no/such/tokenizer", 50)  # the fixed fallback


def test_power_of_two_scales_leave_the_margin():
    amax = torch.tensor([448.0 / MARGIN, 448.0 / MARGIN * 1.01, 1e-3, 0.0])
    scales = power_of_two_scales(amax)
    assert scales.tolist()[:2] == [1.0, 2.0] and scales[3] == 1.0
    assert torch.all(amax * MARGIN / scales <= 448.0) and torch.all(amax[:3] * MARGIN / scales[:3] > 224.0)
