"""The wheel as a user installs it: one top-level package, the commands, a serving cluster.

The wheel is built from a copy of the tracked sources, installed into a fresh virtual
environment that sees the dependencies already installed here (a .pth line to this
interpreter's site-packages, so no network) but not the checkout or its editable
install, and the cluster is started from that environment in a directory outside the
checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest

from tandem.engine.demo_model import make_tiny_checkpoint
from tandem.redis_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _copy_sources(dest: Path) -> None:
    if (ROOT / ".git").exists():
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    else:
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for name in files:
        if (ROOT / name).is_file() and not name.startswith(("tests/", "docs/")):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the venv's bin directory, a working directory outside the checkout)."""
    base = tmp_path_factory.mktemp("wheel")
    src, dist, venv, work = base / "src", base / "dist", base / "venv", base / "work"
    for folder in (src, dist, work):
        folder.mkdir()
    _copy_sources(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("tandem-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    site = Path(subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies installed here, and nothing else: lines of a .pth file are added to
    # sys.path, but .pth files inside them (the checkout's editable finder) are not run
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "_tandem_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    return wheel, bin_dir, work


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", TANDEM_CACHE=env.get("TANDEM_CACHE", ""))
    return {k: v for k, v in env.items() if v}


def test_the_wheels_top_level_holds_only_tandem(installed):
    wheel, _, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
        names = set(archive.namelist())
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tandem"}
    assert len([t for t in tops if t.endswith(".dist-info")]) == 1
    for package in ("cluster", "engine", "kernels", "kvtransfer", "prefill", "decode", "gateway", "bench"):
        assert f"tandem/{package}/__init__.py" in names
    assert "tandem/gateway/admin.proto" in names


def test_the_installed_commands_run_from_the_wheel(installed):
    _, bin_dir, work = installed
    env = _clean_env()
    for argv in ([str(bin_dir / "tandem"), "--help"], [str(bin_dir / "python"), "-m", "tandem", "--help"]):
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "serve" in done.stdout, done.stderr
    where = subprocess.run([str(bin_dir / "python"), "-c", "import tandem.gateway.admin, tandem.cluster as c; print(c.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert str(bin_dir.parent) in where.stdout and str(ROOT) not in where.stdout


def test_a_cluster_started_from_the_wheel_serves_a_request(installed, tmp_path):
    _, bin_dir, work = installed
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    port = free_port()
    proc = subprocess.Popen(
        [str(bin_dir / "tandem"), "serve", "--model", model, "--port", str(port), "--admin-port", "0",
         "--device", "cpu", "--tokens-per-block", "4", "--max-seq-len", "256"],
        cwd=work, env=_clean_env(), stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.err", "wb"), text=True)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line, (line, (tmp_path / "serve.err").read_text()[-3000:])
        body = {"model": os.path.basename(model), "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
