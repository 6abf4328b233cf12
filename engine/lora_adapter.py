"""A PEFT LoRA adapter read from its directory and checked against the base model.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose
tensors are named ``base_model.model.model.layers.<i>.<self_attn|mlp>.<target>.lora_<A|B>.weight``:
A [r, in_features] and B [out_features, r] of one projection of one decoder layer. The engine
serves LoRA on the decoder projections q/k/v/o_proj and gate/up/down_proj (any subset, any rank up
to the engine's maximum); the weights the file holds say which modules of which layers an
adapter targets (PEFT saved exactly the modules its ``target_modules``, ``exclude_modules`` and
``layers_to_transform`` matched).

Each module's scaling is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``, with the module's own r and alpha where ``rank_pattern`` / ``alpha_pattern``
name it (matched as PEFT matches a pattern key against the module's name). An output is
base(x) + (x @ A^T @ B^T) * scaling.

Everything that would compute something else is refused with an ``AdapterError`` naming the
reason, before anything is kept: options the engine does not apply (DoRA, biases, modules_to_save,
...), ranks above the maximum, modules other than the seven projections, shapes of another base
model, and missing, unreadable or inconsistent files.

``LoraAdapter.digest``: sha256 over every module's scaling and A and B tensors as stored (dtype,
shape, bytes), in layer then projection order: two workers holding the same digest compute the
same outputs with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass

import numpy
import torch
from safetensors.torch import load as safetensors_load

from tandem.engine.config import ModelConfig

# the decoder projections LoRA applies to, with the submodule each sits in (HF's names)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# adapter_config.json options that change what the weights compute, refused when set (truthy)
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "fan_in_fan_out": "fan_in_fan_out (weights stored transposed)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "modules_to_save (trained copies of other modules)",
    "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "megatron_config": "megatron_config",
    "arrow_config": "Arrow routing (arrow_config)",
}
_LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<target>\w+)$")


class AdapterError(ValueError):
    """An adapter the engine will not serve. ``reason``: "file" (missing, unreadable or inconsistent),
    "option" (an adapter_config.json option the engine does not apply), "rank" (above the maximum),
    "targets" (modules other than the decoder projections), "shape" (another base model's shapes)
    or "name" (the name is taken: engine.lora_manager)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class LoraModule:
    """One projection's LoRA in one layer: A [r, in_features], B [out_features, r] as stored."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    modules: dict[tuple[int, str], LoraModule]  # (layer, target) -> its weights, on the host
    digest: str  # sha256 hex (module docstring)

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(m.rank for m in self.modules.values())

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(target for _, target in self.modules)

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """target -> (in_features, out_features) of that projection in ``config``'s model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_lora_adapter(path: str | os.PathLike, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT adapter in directory ``path`` for ``config``'s model -> its weights
    on the host, as stored. Raises ``AdapterError`` naming the reason."""
    path = os.fspath(path)
    peft = _read_config(path)
    _check_options(peft, max_rank)
    tensors, stored = _read_tensors(path)
    _check_finite(stored)
    modules, tensor_names = _modules(tensors, peft, config, max_rank)
    return LoraAdapter(path=path, modules=modules, digest=_digest(modules, tensor_names, stored))


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise AdapterError("file", f"no adapter directory at {path!r}")
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            peft = json.load(f)
    except FileNotFoundError:
        raise AdapterError("file", f"{path!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise AdapterError("file", f"{file!r} is not readable JSON: {e}") from None
    if not isinstance(peft, dict):
        raise AdapterError("file", f"{file!r} does not hold a JSON object")
    return peft


def _check_options(peft: dict, max_rank: int) -> None:
    if peft.get("peft_type", "LORA") != "LORA":
        raise AdapterError("option", f"peft_type {peft.get('peft_type')!r} is not LoRA")
    refused = [what for key, what in _REFUSED_OPTIONS.items() if peft.get(key)]
    if peft.get("bias", "none") != "none":
        refused.append(f"bias {peft['bias']!r} (only 'none')")
    if refused:
        raise AdapterError("option", f"unsupported adapter options: {', '.join(refused)}")
    targets = peft.get("target_modules")
    if isinstance(targets, (list, tuple)):  # names (a module's name or a suffix of it); a str is a regex
        lacking = sorted({str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in TARGETS})
        if lacking:
            raise AdapterError("targets", f"target modules {lacking} are not LoRA targets of this model "
                                          f"(it serves LoRA on {', '.join(TARGETS)})")
    r = peft.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError("file", f"adapter_config.json's r is {r!r}, not a positive integer")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(peft.get(key) or {}, dict):
            raise AdapterError("file", f"adapter_config.json's {key} is not an object")
    ranks = [r, *(peft.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise AdapterError("rank", f"rank {max(ranks)} is above the maximum LoRA rank {max_rank}")


@dataclass
class _Stored:
    """The weights file as read: its bytes, and each tensor's dtype and byte range in them."""

    data: bytes
    ranges: dict[str, tuple[str, int, int]]  # name -> (safetensors dtype, start, end)


def _read_tensors(path: str) -> tuple[dict[str, torch.Tensor], _Stored]:
    """The file's tensors, read in a few calls, not a few per tensor: this runs on a worker's
    thread beside its step loop, and every call that lets the GIL go waits to get it back (a
    llama3-8b rank-16 adapter: 0.55 s alone, 8 s beside a busy thread when read tensor by tensor)."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        other = " (only safetensors adapters are read)" if os.path.exists(os.path.join(path, "adapter_model.bin")) else ""
        raise AdapterError("file", f"{path!r} has no {WEIGHTS_FILE}{other}")
    try:
        with open(file, "rb") as f:
            data = f.read()
        tensors = safetensors_load(data)
        (header_len,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8:8 + header_len])
        base = 8 + header_len
        ranges = {name: (entry["dtype"], base + entry["data_offsets"][0], base + entry["data_offsets"][1])
                  for name, entry in header.items() if name != "__metadata__"}
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise AdapterError("file", f"{file!r} is not a readable safetensors file: {e}") from None
    return tensors, _Stored(data, ranges)


# the exponent bits of each float format: all ones is an infinity or a NaN
_EXPONENT = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000),
             "F64": ("<u8", 0x7FF0000000000000)}


def _check_finite(stored: _Stored) -> None:
    """No NaN or infinity in any float tensor: one scan per run of same-typed tensors stored back
    to back (usually the whole file), on the stored bits."""
    runs: list[list] = []  # [dtype, start, end, names]
    for name, (dtype, start, end) in sorted(stored.ranges.items(), key=lambda item: item[1][1]):
        if dtype not in _EXPONENT:
            continue  # not a float: _modules names it
        if runs and runs[-1][0] == dtype and runs[-1][2] == start:
            runs[-1][2] = end
            runs[-1][3].append(name)
        else:
            runs.append([dtype, start, end, [name]])
    for dtype, start, end, names in runs:
        if _nonfinite(stored.data, dtype, start, end):
            bad = next(n for n in names if _nonfinite(stored.data, *stored.ranges[n]))
            module = _LORA_TENSOR.match(bad)
            raise AdapterError("file", f"{module['module'] if module else bad}: its weights hold NaN or infinite values")


def _nonfinite(data: bytes, dtype: str, start: int, end: int) -> bool:
    """Whether bytes start..end of ``data``, floats of safetensors type ``dtype``, hold a NaN or infinity."""
    word, mask = _EXPONENT[dtype]
    bits = numpy.frombuffer(data, dtype=word, count=(end - start) // numpy.dtype(word).itemsize, offset=start)
    return bool(((bits & mask) == mask).any())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: the first pattern key k (in the file's order) such that the module's name
    matches ``(.*\\.)?(k)$``; its value, else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _modules(tensors: dict[str, torch.Tensor], peft: dict, config: ModelConfig,
             max_rank: int) -> tuple[dict[tuple[int, str], LoraModule], dict[tuple[int, str], tuple[str, str]]]:
    """-> (modules, each module's A and B tensor names in the file)."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    pair_names: dict[tuple[int, str], dict[str, str]] = {}
    names: dict[tuple[int, str], str] = {}
    for name, tensor in tensors.items():
        found = _LORA_TENSOR.match(name)
        if found is None:
            raise AdapterError(*_not_lora(name))
        module = found["module"]
        layer = _LAYER_MODULE.match(module)
        if layer is None or _PARENT.get(layer["target"]) != layer["parent"]:
            raise AdapterError("targets", f"{name!r}: LoRA on {module!r}, which is not a LoRA target of this "
                                          f"model (it serves LoRA on {', '.join(TARGETS)})")
        key = (int(layer["layer"]), layer["target"])
        pairs.setdefault(key, {})[found["which"]] = tensor
        pair_names.setdefault(key, {})[found["which"]] = name
        names[key] = module
    if not pairs:
        raise AdapterError("file", f"{WEIGHTS_FILE} holds no LoRA weights")
    shapes = target_shapes(config)
    rank_pattern, alpha_pattern = peft.get("rank_pattern") or {}, peft.get("alpha_pattern") or {}
    modules = {}
    for (layer, target), pair in sorted(pairs.items(), key=lambda item: (item[0][0], TARGETS.index(item[0][1]))):
        module = names[(layer, target)]
        if set(pair) != {"A", "B"}:
            raise AdapterError("file", f"{module}: lora_{'AB'[('A' in pair)]} is missing")
        a, b = pair["A"], pair["B"]
        if layer >= config.num_layers:
            raise AdapterError("shape", f"{module}: layer {layer}, but the model has {config.num_layers} layers "
                                        "(an adapter for another base model)")
        for which, t in (("A", a), ("B", b)):
            if t.dim() != 2 or not t.is_floating_point():
                raise AdapterError("file", f"{module}.lora_{which} is {t.dtype} {list(t.shape)}, not a float matrix")
        r = _pattern_value(rank_pattern, module, peft["r"])
        alpha = _pattern_value(alpha_pattern, module, peft.get("lora_alpha", 8))
        if a.shape[0] != r or b.shape[1] != r:
            raise AdapterError("file", f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have "
                                       f"the rank {r} adapter_config.json gives it")
        if r > max_rank:
            raise AdapterError("rank", f"{module}: rank {r} is above the maximum LoRA rank {max_rank}")
        in_features, out_features = shapes[target]
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise AdapterError("shape", f"{module}: lora_A {list(a.shape)}, lora_B {list(b.shape)}, but this model's "
                                        f"{target} maps {in_features} to {out_features} features "
                                        "(an adapter for another base model)")
        scaling = alpha / math.sqrt(r) if peft.get("use_rslora") else alpha / r
        modules[(layer, target)] = LoraModule(a, b, float(scaling))
    return modules, {key: (pair_names[key]["A"], pair_names[key]["B"]) for key in modules}


def _not_lora(name: str) -> tuple[str, str]:
    if "lora_magnitude_vector" in name:
        return "option", f"{name!r}: DoRA magnitudes are not supported"
    if "lora_embedding" in name:
        return "targets", f"{name!r}: LoRA on embeddings is not supported (only on the decoder projections)"
    if ".lora_B.bias" in name or name.endswith(".bias"):
        return "option", f"{name!r}: LoRA biases are not supported"
    return "file", f"{name!r} is not a LoRA weight (lora_A / lora_B of a module)"


def _digest(modules: dict[tuple[int, str], LoraModule], tensor_names: dict[tuple[int, str], tuple[str, str]],
            stored: _Stored) -> str:
    """sha256 over each module's scaling, then its A and B (dtype, shape, stored bytes), in layer then
    TARGETS order; hashed in one call over the file's own bytes (see ``_read_tensors``)."""
    pieces = []
    for (layer, target), m in modules.items():  # already in layer, then TARGETS order
        pieces.append(f"{layer}.{target}:{m.scaling!r};".encode())
        for t, name in zip((m.a, m.b), tensor_names[(layer, target)]):
            _, start, end = stored.ranges[name]
            pieces.append(f"{t.dtype}{list(t.shape)};".encode())
            pieces.append(memoryview(stored.data)[start:end])
    return hashlib.sha256(b"".join(pieces)).hexdigest()
