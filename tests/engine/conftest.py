"""Tiny checkpoints shared by the engine tests (built once per session, locally)."""

from __future__ import annotations

import pytest

from tandem.engine.demo_model import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """arch -> checkpoint dir for "llama" (llama3 rope, tied), "qwen2" (biases), "mistral" (window 24)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def tiny_qwen2_windowed(tmp_path_factory) -> str:
    """Qwen2 whose second layer only uses a sliding window (use_sliding_window, max_window_layers=1)."""
    root = tmp_path_factory.mktemp("tiny_qwen2_windowed")
    return make_tiny_checkpoint(root, "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
