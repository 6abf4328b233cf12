"""One settings surface: every operator setting is a field of ``Settings`` with its flag, its
variable (``TANDEM_<FLAG>``) and its default in one place; ``tandem serve --help`` and ``tandem
config`` show each; product code reads no other variable of ours and assigns no other module's
globals."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cluster.settings import GROUPS, Settings, SettingsError, add_arguments, env_name, flag_name
from tandem.kernels import switches

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("cluster", "engine", "kernels", "kvtransfer", "gateway", "prefill", "decode", "tandem", "bench")
# other programs' variables, read where they say (not tandem settings)
FOREIGN = {"TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "PROMETHEUS_MULTIPROC_DIR", "OMP_NUM_THREADS"}
FIELDS = dataclasses.fields(Settings)


def test_every_setting_has_a_group_help_and_the_one_variable_rule():
    for f in FIELDS:
        assert f.metadata["group"] in GROUPS and f.metadata["help"], f.name
        assert env_name(f) == "TANDEM_" + flag_name(f)[2:].upper().replace("-", "_")
    assert len({env_name(f) for f in FIELDS}) == len(FIELDS)


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("TANDEM_MAX_BATCH_SIZE", "12")
    monkeypatch.setenv("TANDEM_KV_HOST", "10.0.0.7")
    monkeypatch.setenv("TANDEM_ENABLE_PREFIX_CACHING", "yes")
    monkeypatch.setenv("TANDEM_SERVED_MODEL_NAME", "")  # empty: unset
    args = parser.parse_args(["--max-batch-size", "3"])
    settings, sources = Settings.from_args(args), Settings.sources(args)
    assert settings.max_batch_size == 3 and sources["max_batch_size"] == "flag"
    assert settings.kv_host == "10.0.0.7" and sources["kv_host"] == "env TANDEM_KV_HOST"
    assert settings.enable_prefix_caching is True
    assert settings.served_model_name is None and sources["served_model_name"] == "default"
    monkeypatch.setenv("TANDEM_PORT", "eighty")
    with pytest.raises(SettingsError, match="TANDEM_PORT='eighty': not a valid int"):
        Settings.from_args(parser.parse_args([]))
    monkeypatch.setenv("TANDEM_PORT", "8001")
    monkeypatch.setenv("TANDEM_POOLS", "both")
    with pytest.raises(SettingsError, match="TANDEM_POOLS must be one of"):
        Settings.from_args(parser.parse_args([]))


def test_serve_help_and_config_show_every_setting(tmp_path):
    from tandem.engine.demo_model import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m", "llama")
    run = lambda *argv: subprocess.run([sys.executable, "-m", "tandem", *argv], capture_output=True,  # noqa: E731
                                       text=True, timeout=120, cwd=tmp_path)
    help_text = run("serve", "--help").stdout
    config = run("config", "--model", model, "--max-batch-size", "7")
    assert config.returncode == 0, config.stderr
    for group in GROUPS:
        assert f"{group} settings:" in help_text
        assert f"{group}:" in config.stdout
    for f in FIELDS:
        assert flag_name(f) in help_text and env_name(f) in help_text, f.name
        assert f"  {flag_name(f)[2:]} " in config.stdout, f.name
    lines = {line.split()[0]: line for line in config.stdout.splitlines() if line.startswith("  ")}
    assert lines["max-batch-size"].split()[1:] == ["7", "flag"]
    assert lines["max-seq-len"].split()[-1] == "model" and lines["port"].split()[1:] == ["8000", "default"]
    for f in dataclasses.fields(switches.KernelSwitches):
        assert switches.env_name(f.name) in config.stdout


def _env_reads(tree: ast.AST):
    """(line, the variable's name or the expression) of every read of the environment."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "environ") or \
                    (f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                yield node.lineno, node.args[0]
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "environ" and isinstance(node.ctx, ast.Load):
            yield node.lineno, node.slice


def _product_files():
    for folder in PRODUCT:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_product_code_reads_only_settings_variables():
    ours = {env_name(f) for f in FIELDS} | {switches.env_name(f.name) for f in dataclasses.fields(switches.KernelSwitches)}
    readers = {ROOT / "cluster" / "settings.py", ROOT / "kernels" / "switches.py"}  # the rule's two places
    problems = []
    for path in _product_files():
        for line, arg in _env_reads(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{line}"
            if not isinstance(arg, ast.Constant):
                if path not in readers:
                    problems.append(f"{where} reads a variable named at run time: {ast.unparse(arg)}")
            elif arg.value.startswith("TANDEM_") and path not in readers:
                problems.append(f"{where} reads {arg.value} itself (a setting is read through Settings)")
            elif not arg.value.startswith("TANDEM_") and arg.value not in FOREIGN:
                problems.append(f"{where} reads {arg.value}, which no setting declares")
            elif arg.value.startswith("TANDEM_") and arg.value not in ours:
                problems.append(f"{where} reads {arg.value}, which no setting declares")
    assert not problems, "\n".join(problems)


def _module_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                try:
                    if importlib.util.find_spec(f"{node.module}.{a.name}") is not None:
                        names.add(a.asname or a.name)
                except (ImportError, ValueError):
                    pass
    return names


def test_product_code_assigns_no_other_module_s_globals():
    problems = []
    for path in _product_files():
        tree = ast.parse(path.read_text())
        modules = _module_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                            and sub.value.id in modules and isinstance(sub.ctx, ast.Store):
                        problems.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {ast.unparse(sub)}")
    assert not problems, "\n".join(problems)
