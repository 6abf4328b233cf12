"""The installed layout: one `tandem` namespace over the repository's folders."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(config["packages"]) == sorted(config["package-dir"])
    return config["package-dir"]


def test_every_package_is_a_folder_of_the_layout_under_the_tandem_namespace():
    dirs = _package_dirs()
    assert all(name == "tandem" or name.startswith("tandem.") for name in dirs)
    for name, folder in dirs.items():
        assert (ROOT / folder / "__init__.py").is_file(), folder
    # every folder holding our Python packages is mapped (a new one would otherwise be left out)
    mapped = set(dirs.values())
    for init in ROOT.glob("*/__init__.py"):
        assert init.parent.name in mapped | {"tests"}, init.parent.name


def test_the_image_copies_every_package_folder():
    copied = set(re.findall(r"^COPY (\S+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert set(_package_dirs().values()) <= copied


def test_transformers_does_not_take_a_package_of_ours_for_the_hub_kernels_one():
    """transformers finds the PyPI package ``kernels`` where it is installed (transformers 5.25
    requires it), never the checkout's kernels/ folder (tandem.import_guard)."""
    import importlib.metadata
    import importlib.util

    from transformers.utils import import_utils

    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    spec = importlib.util.find_spec("kernels")
    assert (spec is not None) == installed
    if spec is not None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) != os.path.realpath(root), spec.origin
        assert import_utils.is_kernels_available()


def test_gateway_and_schedulers_do_not_import_torch():
    code = (
        "import sys; import tandem.gateway.app, tandem.decode.scheduler, tandem.prefill.scheduler, "
        "tandem.engine.block_allocator, tandem.cli, tandem.cluster.policies;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_lists_every_service():
    out = subprocess.run([sys.executable, "-m", "tandem", "--help"], capture_output=True, text=True, check=True)
    for command in ("serve", "gateway", "prefill", "decode", "bench"):
        assert command in out.stdout
