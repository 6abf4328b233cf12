"""The demo model: a tiny random-weight Llama with a locally built tokenizer.

It lets `tandem serve` run on a fresh machine with no weights and no network.
Its output is gibberish by construction; pass --model for a real checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def demo_model_path() -> str:
    root = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "demo-llama"
    if not (root / "config.json").is_file():
        # built in a child so the launcher itself never imports torch
        subprocess.run([sys.executable, "-m", "cluster.cli", "demo-model", str(root)], check=True,
                       stdout=subprocess.DEVNULL)
    return str(root)
