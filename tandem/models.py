"""Which checkpoint `--model` names.

    demo   a tiny random-weight Llama with a locally built tokenizer, written on
           first use under $TANDEM_CACHE (default ~/.cache/tandem); it lets the
           whole cluster run on a fresh machine with no weights and no network,
           and its text is gibberish by construction
    PATH   a checkpoint directory, used as it is
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEMO = "demo"


def demo_model_path() -> str:
    root = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "demo-llama"
    if not (root / "config.json").is_file():
        # built in a child so the launcher itself never imports torch
        subprocess.run([sys.executable, "-m", "tandem", "demo-model", str(root)], check=True,
                       stdout=subprocess.DEVNULL)
    return str(root)


def resolve_model(model: str) -> str:
    """The checkpoint directory `--model` names (building the demo model on first use)."""
    if model != DEMO:
        return model
    return demo_model_path()
