"""No copy from pageable host memory in what runs while a worker serves: ``torch.tensor(...,
device=...)`` waits for every kernel queued on the stream, so a step prepared while the previous
one runs would stall the host for it (``engine.device_copy`` says why and has the asynchronous
form). Read with ast: a torch.tensor or torch.as_tensor call with a device is what stalls
(torch.zeros, torch.empty and the like allocate on the device and do not)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = ["engine", "decode", "prefill", "kvtransfer"]
ALLOWED: dict[str, str] = {}  # file -> why a synchronous copy is right there (none is today)


def _host_value_copies_to_a_device(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("tensor", "as_tensor") and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch" and any(k.arg == "device" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_serving_code_copies_host_values_to_the_device_without_waiting_for_it():
    found = []
    for folder in SERVING:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in ALLOWED:
                continue
            found += [f"{rel}:{line}" for line in _host_value_copies_to_a_device(path)]
    assert not found, "torch.tensor(..., device=...) waits for the device; use engine.device_copy: " + ", ".join(found)


def test_the_check_sees_the_synchronous_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nids = torch.tensor([1, 2], device='cuda')\nok = torch.tensor([1, 2])\n")
    assert _host_value_copies_to_a_device(sample) == [2]
