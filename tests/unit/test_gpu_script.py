"""scripts/gpu.sh names only what exists: every `python3 -m tandem.bench.X ...` it runs parses with
that module's own argument parser (shell variables stood in), and every test path it hands pytest
is there. A GPU run costs scarce device time; a flag renamed since is found here instead."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu.sh"
ENDS = {"2>&1", "|", ";", "&&", ">", "||"}


def _logical_lines() -> list[str]:
    """The script's lines with their continuations joined, comments dropped."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if not line.lstrip().startswith("#")]


def _stand_in(line: str, loops: dict[str, str] | None = None) -> str:
    """Shell expansions stood in: a default where the script gives one, a loop's variable its
    first value, arrays of flags dropped, any other variable a small number (a valid count,
    size or path part)."""
    line = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", line)
    line = re.sub(r'"\$\{\w+\[@\]\}"', "", line)
    for name, value in (loops or {}).items():
        line = re.sub(r"\$\{?" + name + r"\b\}?", value, line)
    return re.sub(r"\$\{?\w+\}?", "8", line)


def _command(tokens: list[str], start: int) -> list[str]:
    out = []
    for token in tokens[start:]:
        if token in ENDS or token.startswith(">"):
            break
        out.append(token)
    return out


def _bench_calls() -> list[tuple[str, list[str]]]:
    """(module, argv) of every bench module the script runs; the offline rows' argument arrays
    (``args=(...)``) go with the cluster benchmark's call that takes them."""
    calls, arrays, loops = [], [], {}
    for line in _logical_lines():
        loop = re.match(r"\s*for (\w+) in (.*?); do", _stand_in(line, loops))
        if loop:
            loops[loop.group(1)] = loop.group(2).split()[0]
        line = _stand_in(line, loops)
        array = re.search(r"\bargs=\((.*)\)", line)
        if array:
            arrays.append(shlex.split(array.group(1)))
        if "python3 -m tandem.bench." not in line:
            continue
        tokens = shlex.split(line)
        at = tokens.index("-m") + 1
        module, argv = tokens[at], _command(tokens, at + 1)
        if module == "tandem.bench.cluster_mixed" and '"${args[@]}"' in line:
            calls.extend((module, argv + extra) for extra in arrays)
        else:
            calls.append((module, argv))
    return calls


class _Parsed(Exception):
    pass


CALLS = _bench_calls()


def test_the_script_runs_bench_modules():
    modules = {module for module, _ in CALLS}
    assert {"tandem.bench.cluster_mixed", "tandem.bench.decode_profile", "tandem.bench.tune_fp8",
            "tandem.bench.lora_step"} <= modules, modules


@pytest.mark.parametrize("module, argv", CALLS, ids=[f"{m.split('.')[-1]}-{i}" for i, (m, _) in enumerate(CALLS)])
def test_each_bench_call_parses(monkeypatch, module, argv):
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)  # an unknown flag or a bad value exits here (status 2)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr("sys.argv", [module, *argv])
    with pytest.raises(_Parsed):
        runpy.run_module(module, run_name="__main__")  # as python3 -m runs it


def test_every_test_path_the_script_names_exists():
    paths = set()
    for line in _logical_lines():
        if "-m pytest" not in line:
            continue
        tokens = shlex.split(_stand_in(line))
        paths.update(t.split("::")[0] for t in _command(tokens, tokens.index("pytest") + 1) if t.startswith("tests/"))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing
