"""PEFT adapters read and checked (engine.lora_adapter), and the device slots they go into
(engine.lora_weights, engine.lora_manager): PEFT's scaling, the digest, every refused adapter
with its reason and nothing loaded changed by it, LRU eviction, and slot writes that touch no
other slot."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from lora_testing import edit_config, make_peft_adapter
from safetensors.torch import load_file, save_file

from tandem.engine.attention import SeqChunk
from tandem.engine.config import ModelConfig
from tandem.engine.demo_model import make_tiny_checkpoint
from tandem.engine.lora_adapter import AdapterError, load_lora_adapter
from tandem.engine.lora_batch import build_lora_batch
from tandem.engine.lora_manager import LoraManager
from tandem.engine.lora_weights import PROJECTION_TARGETS, LoraWeights
from tandem.engine.runner import ModelRunner

MAX_RANK = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def base(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def config(base) -> ModelConfig:
    return ModelConfig.from_pretrained(base)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_peft_adapter(base, root / "a", 4, 8, ALL, seed=1),
        "b": make_peft_adapter(base, root / "b", 8, 16, ["q_proj", "v_proj", "down_proj"], seed=2, use_rslora=True),
        "c": make_peft_adapter(base, root / "c", 16, 32, ["k_proj", "o_proj", "up_proj"], seed=3,
                               rank_pattern={"up_proj": 2}, alpha_pattern={r"layers\.1\.self_attn\.k_proj": 5}),
    }


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return os.fspath(dst)


def _manager(config, max_loras=2, max_cpu_loras=4) -> LoraManager:
    return LoraManager(LoraWeights(config, max_loras, MAX_RANK, torch.float32, "cpu"), config, max_cpu_loras)


def _snapshot(weights: LoraWeights) -> list[torch.Tensor]:
    return [t.clone() for layer in weights.layers for p in layer.values() for t in (p.a, *p.b, p.scales)]


def _unchanged(weights: LoraWeights, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_snapshot(weights), before))


# ---- reading ------------------------------------------------------------------------------------

def test_scaling_and_targets_are_pefts(base, config, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for name, path in adapters.items():
        ours = load_lora_adapter(path, config, MAX_RANK)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)
        theirs = {}
        for module_name, module in model.named_modules():
            if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling:
                parts = module_name.split(".")
                layer, target = int(parts[parts.index("layers") + 1]), parts[-1]
                theirs[(layer, target)] = (module.scaling["default"], module.r["default"])
        assert {key: (m.scaling, m.rank) for key, m in ours.modules.items()} == theirs, name
    c = load_lora_adapter(adapters["c"], config, MAX_RANK)
    assert c.modules[(0, "up_proj")].rank == 2 and c.modules[(0, "up_proj")].scaling == 16.0
    assert c.modules[(1, "k_proj")].scaling == 5 / 16 and c.modules[(0, "k_proj")].scaling == 2.0
    b = load_lora_adapter(adapters["b"], config, MAX_RANK)
    assert b.modules[(0, "q_proj")].scaling == 16 / math.sqrt(8) and b.targets == {"q_proj", "v_proj", "down_proj"}


def test_the_digest_is_the_weights(config, adapters, tmp_path):
    a = load_lora_adapter(adapters["a"], config, MAX_RANK)
    copy = _copy(adapters["a"], tmp_path / "copy")
    assert load_lora_adapter(copy, config, MAX_RANK).digest == a.digest  # another path, the same weights
    edit_config(copy, lora_alpha=9)
    assert load_lora_adapter(copy, config, MAX_RANK).digest != a.digest  # another scaling
    other = _copy(adapters["a"], tmp_path / "other")
    tensors = load_file(os.path.join(other, WEIGHTS))
    name = next(n for n in tensors if "lora_B" in n)
    tensors[name][0, 0] += 1e-3
    save_file(tensors, os.path.join(other, WEIGHTS))
    assert load_lora_adapter(other, config, MAX_RANK).digest != a.digest
    assert len(a.digest) == 64 and load_lora_adapter(adapters["b"], config, MAX_RANK).digest != a.digest


# ---- refused adapters ----------------------------------------------------------------------------

def _truncated(path, tmp_path):
    broken = _copy(path, tmp_path / "truncated")
    file = os.path.join(broken, WEIGHTS)
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])
    return broken


def _garbage_header(path, tmp_path):
    broken = _copy(path, tmp_path / "garbage")
    open(os.path.join(broken, WEIGHTS), "wb").write(b"\xff" * 64)
    return broken


def _without(path, tmp_path, file):
    broken = _copy(path, tmp_path / f"without_{file}")
    os.remove(os.path.join(broken, file))
    return broken


def _bin_only(path, tmp_path):
    broken = _without(path, tmp_path, WEIGHTS)
    open(os.path.join(broken, "adapter_model.bin"), "wb").write(b"pickle")
    return broken


def _bad_json(path, tmp_path):
    broken = _copy(path, tmp_path / "bad_json")
    open(os.path.join(broken, "adapter_config.json"), "w").write("{not json")
    return broken


def _tensors_changed(path, tmp_path, change, tag):
    broken = _copy(path, tmp_path / tag)
    tensors = load_file(os.path.join(broken, WEIGHTS))
    change(tensors)
    save_file(tensors, os.path.join(broken, WEIGHTS))
    return broken


def _lacking_b(path, tmp_path):
    return _tensors_changed(path, tmp_path, lambda t: t.pop(next(n for n in sorted(t) if "lora_B" in n)), "lacking_b")


def _nan(path, tmp_path):
    def poison(t):
        t[next(n for n in sorted(t) if "lora_A" in n)][0, 0] = float("nan")
    return _tensors_changed(path, tmp_path, poison, "nan")


def _lm_head_tensor(path, tmp_path):
    def add(t):
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
        t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(512, 4)
    broken = _tensors_changed(path, tmp_path, add, "lm_head")
    edit_config(broken, target_modules=".*(proj|lm_head)")  # a regex: the tensors say what it matched
    return broken


def _edited(path, tmp_path, tag, **changes):
    broken = _copy(path, tmp_path / tag)
    edit_config(broken, **changes)
    return broken


CASES = {
    # case: (reason, words the message holds, how to break adapter "a")
    "rank above the limit": ("rank", "rank 32 is above the maximum LoRA rank 16",
                             lambda base, a, tmp: make_peft_adapter(base, tmp / "r32", 32, 32, ALL)),
    "rank_pattern above the limit": ("rank", "rank 20", lambda base, a, tmp: make_peft_adapter(
        base, tmp / "pattern", 8, 8, ALL, rank_pattern={"down_proj": 20})),
    "a target the model lacks": ("targets", "['fc1']", lambda base, a, tmp: _edited(a, tmp, "fc1",
                                                                                   target_modules=["q_proj", "fc1"])),
    "embeddings": ("targets", "embed_tokens", lambda base, a, tmp: make_peft_adapter(
        base, tmp / "embed", 4, 8, ["q_proj", "embed_tokens"])),
    "LoRA weights on lm_head": ("targets", "lm_head", lambda base, a, tmp: _lm_head_tensor(a, tmp)),
    "another model's widths": ("shape", "another base model", lambda base, a, tmp: make_peft_adapter(
        make_tiny_checkpoint(tmp / "wider", "llama", intermediate_size=96), tmp / "wide", 4, 8, ALL)),
    "another model's depth": ("shape", "layer 2", lambda base, a, tmp: make_peft_adapter(
        make_tiny_checkpoint(tmp / "deeper", "llama", num_hidden_layers=3), tmp / "deep", 4, 8, ["q_proj"])),
    "DoRA": ("option", "DoRA", lambda base, a, tmp: make_peft_adapter(base, tmp / "dora", 4, 8, ALL, use_dora=True)),
    "bias": ("option", "bias 'all'", lambda base, a, tmp: _edited(a, tmp, "bias", bias="all")),
    "modules_to_save": ("option", "modules_to_save",
                        lambda base, a, tmp: _edited(a, tmp, "mts", modules_to_save=["lm_head"])),
    "fan_in_fan_out": ("option", "fan_in_fan_out", lambda base, a, tmp: _edited(a, tmp, "fifo", fan_in_fan_out=True)),
    "another PEFT method": ("option", "IA3", lambda base, a, tmp: _edited(a, tmp, "ia3", peft_type="IA3")),
    "a truncated file": ("file", "not a readable safetensors", lambda base, a, tmp: _truncated(a, tmp)),
    "a garbage file": ("file", "not a readable safetensors", lambda base, a, tmp: _garbage_header(a, tmp)),
    "no weights file": ("file", "has no adapter_model.safetensors",
                        lambda base, a, tmp: _without(a, tmp, WEIGHTS)),
    "pickled weights only": ("file", "only safetensors", lambda base, a, tmp: _bin_only(a, tmp)),
    "no config": ("file", "has no adapter_config.json",
                  lambda base, a, tmp: _without(a, tmp, "adapter_config.json")),
    "a config that is not JSON": ("file", "not readable JSON", lambda base, a, tmp: _bad_json(a, tmp)),
    "no directory": ("file", "no adapter directory", lambda base, a, tmp: os.fspath(tmp / "nowhere")),
    "a lora_B missing": ("file", "lora_B is missing", lambda base, a, tmp: _lacking_b(a, tmp)),
    "NaN weights": ("file", "NaN", lambda base, a, tmp: _nan(a, tmp)),
    "a rank other than the config's": ("file", "rank 8", lambda base, a, tmp: _edited(a, tmp, "r8", r=8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_adapter_names_its_reason_and_changes_nothing(case, base, config, adapters, tmp_path):
    reason, words, breaks = CASES[case]
    manager = _manager(config)
    manager.add("a", adapters["a"])
    manager.add("b", adapters["b"])
    manager.slots_for(["a", "b"])
    before, slots = _snapshot(manager.weights), (manager.slot_of("a"), manager.slot_of("b"))
    bad = breaks(base, adapters["a"], tmp_path)
    with pytest.raises(AdapterError) as raised:
        manager.add("bad", bad)
    assert raised.value.reason == reason and words in str(raised.value), str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert manager.names() == ["a", "b"] and (manager.slot_of("a"), manager.slot_of("b")) == slots
    assert _unchanged(manager.weights, before)


def test_a_taken_name(config, adapters):
    manager = _manager(config)
    first = manager.add("a", adapters["a"])
    assert manager.add("a", adapters["a"]) == first  # the same adapter again: nothing happens
    with pytest.raises(AdapterError) as raised:
        manager.add("a", adapters["b"])
    assert raised.value.reason == "name" and manager.info("a") == first


def test_an_adapter_changed_on_disk_is_refused_when_read_again(config, adapters, tmp_path):
    """Dropped from the host cache, it is read again from its path: other weights there are refused."""
    path = _copy(adapters["a"], tmp_path / "a")
    manager = _manager(config, max_loras=1, max_cpu_loras=1)
    manager.add("a", path)
    manager.add("b", adapters["b"])  # drops a from the host
    manager.slots_for(["b"])
    before = _snapshot(manager.weights)
    edit_config(path, lora_alpha=1)
    with pytest.raises(AdapterError, match="changed since it was loaded"):
        manager.slots_for(["a"])
    assert manager.slot_of("b") == 0 and _unchanged(manager.weights, before)


# ---- slots ----------------------------------------------------------------------------------------

def test_lru_eviction_spares_the_steps_adapters(config, adapters):
    manager = _manager(config, max_loras=2)
    for name in "abc":
        manager.add(name, adapters[name])
    assert manager.slots_for(["a"]) == {"a": 0}
    assert manager.slots_for(["b"]) == {"b": 1}
    manager.slots_for(["a"])  # a used last: b is now the least recently used
    a_slot = _snapshot_slot(manager.weights, 0)
    assert manager.slots_for(["c"]) == {"c": 1}  # b evicted
    assert manager.slot_of("b") is None and _equal_slot(manager.weights, 0, a_slot)
    # b back: a is the least recently used, but the step uses it too, so c goes
    assert manager.slots_for(["b", "a"]) == {"b": 1, "a": 0}
    assert manager.slot_of("c") is None
    with pytest.raises(ValueError, match="uses 3 adapters"):
        manager.slots_for(["a", "b", "c"])
    with pytest.raises(KeyError):
        manager.slots_for(["nope"])
    manager.remove("a")
    assert manager.slot_of("a") is None and not manager.weights.occupied(0)
    assert manager.slots_for(["c"]) == {"c": 0}


def _snapshot_slot(weights: LoraWeights, slot: int) -> list[torch.Tensor]:
    return [t.clone() for layer in weights.layers for p in layer.values()
            for t in (p.a[slot], *(b[slot] for b in p.b), p.scales[:, slot])]


def _equal_slot(weights: LoraWeights, slot: int, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_snapshot_slot(weights, slot), before))


def test_writing_a_slot_touches_no_other_and_pads_with_zeros(config, adapters):
    weights = LoraWeights(config, 3, MAX_RANK, torch.float32, "cpu")
    a, b, c = (load_lora_adapter(adapters[n], config, MAX_RANK) for n in "abc")
    weights.write(0, a)
    weights.write(2, b)
    others = {s: _snapshot_slot(weights, s) for s in (0, 2)}
    weights.write(1, c)
    weights.write(1, b)  # a rank-8 adapter over a rank-16 one: the rest of the slot is zero again
    assert all(_equal_slot(weights, s, others[s]) for s in (0, 2))
    assert _equal_slot(weights, 1, others[2])  # b's entries, wherever b is
    qkv = weights.layers[0]["qkv_proj"]
    assert torch.equal(qkv.a[1, :8], b.modules[(0, "q_proj")].a) and not qkv.a[1, 8:MAX_RANK].any()
    assert not qkv.a[1, MAX_RANK:2 * MAX_RANK].any() and not qkv.b[1][1].any()  # k: not a target of b
    assert qkv.scales[:, 1].tolist() == [pytest.approx(16 / math.sqrt(8)), 0.0, pytest.approx(16 / math.sqrt(8))]
    assert qkv.offsets == [0, 64, 96] and weights.projections(1) == {"qkv_proj", "down_proj"}
    assert set(PROJECTION_TARGETS) == set(weights.layers[0])


def test_a_step_names_only_slots_that_hold_an_adapter(config, base, adapters):
    weights = LoraWeights(config, 2, MAX_RANK, torch.float32, "cpu")
    weights.write(1, load_lora_adapter(adapters["b"], config, MAX_RANK))
    batch = build_lora_batch([(1, 3), (-1, 2), (1, 1)], weights, "cpu")
    assert batch.token_order.tolist() == [0, 1, 2, 5] and batch.seg_slots.tolist() == [1]
    assert batch.projections == {"qkv_proj", "down_proj"}
    assert build_lora_batch([(-1, 4)], weights, "cpu") is None
    with pytest.raises(ValueError, match="slot 0 holds no adapter"):
        build_lora_batch([(0, 1)], weights, "cpu")
    runner = ModelRunner(base, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="enable_lora"):
        runner.forward([SeqChunk([3, 4], 0, [0], lora_slot=0)])


def test_adapter_config_json_is_pefts(adapters):
    """The files the tests build are PEFT's own (a guard on the helper)."""
    with open(os.path.join(adapters["b"], "adapter_config.json")) as f:
        saved = json.load(f)
    assert saved["peft_type"] == "LORA" and saved["use_rslora"] is True and saved["r"] == 8


def test_a_zero_adapter_runs_every_lora_kernel_and_changes_nothing(base):
    """The warm-up's zero adapter (LoraWeights.zero_adapter): within, an empty slot's rows take
    every projection's LoRA and the logits equal the base model's; after, the slot is empty again
    and a step naming it is refused."""
    runner = ModelRunner(base, num_blocks=16, block_size=4)
    weights = runner.enable_lora(max_loras=2, max_rank=8).weights
    prompt = list(range(3, 12))
    plain = runner.forward([SeqChunk(prompt, 0, [0, 1, 2])])
    with weights.zero_adapter(1):
        assert weights.occupied(1) and weights.projections(1) == frozenset(PROJECTION_TARGETS)
        batch = build_lora_batch([(1, len(prompt))], weights, "cpu")
        assert batch.projections == frozenset(PROJECTION_TARGETS)
        with_zero = runner.forward([SeqChunk(prompt, 0, [4, 5, 6], lora_slot=1)])
    assert torch.equal(with_zero, plain)
    assert not weights.occupied(1)
    with pytest.raises(ValueError, match="holds no adapter"):
        runner.forward([SeqChunk(prompt, 0, [4, 5, 6], lora_slot=1)])
