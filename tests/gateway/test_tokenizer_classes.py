"""The gateway's tokenizer is the one AutoTokenizer gives, for checkpoints saved by transformers 5
(which name the generic TokenizersBackend) too, and it never imports torch to get it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tandem.engine.demo_model import make_tiny_checkpoint

TEXTS = ["Hello world", "  leading and   inner   spaces\tand tabs", "lines\n\nand\r\nbreaks\n",
         "digits 1234567890 and 3.14159", "non-ASCII: héllo wörld — 日本語 テキスト 😀", "   ", "x" * 200]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_gateways_tokenizer_equals_auto_tokenizer(arch, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from tandem.cluster.tokenizer import load_tokenizer

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    model = make_tiny_checkpoint(tmp_path / arch, arch)
    auto, ours = AutoTokenizer.from_pretrained(model), load_tokenizer(model)
    assert type(ours).__name__ == type(auto).__name__
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text), text
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))


def test_the_class_is_named_by_auto_tokenizer_even_where_the_checkpoint_names_a_generic_one(tmp_path, monkeypatch):
    import json

    from tandem.cluster.tokenizer import auto_tokenizer_class

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    model = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    config = json.loads((tmp_path / "qwen2" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"  # as transformers 5 saves it
    from pathlib import Path

    assert auto_tokenizer_class(Path(model)) == "Qwen2Tokenizer"  # AutoTokenizer's pick for a Qwen2 model
    assert list((tmp_path / "cache" / "tokenizer-classes").iterdir())  # cached: the next start spawns nothing


def test_the_gateway_resolves_it_without_importing_torch(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "m", "qwen2")
    code = ("import sys; from tandem.cluster.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({model!r}); assert 'torch' not in sys.modules; print(type(t).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"TANDEM_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "Qwen2Tokenizer"


def test_tokenizer_dir_serves_a_checkpoint_without_tokenizer_files(tmp_path, monkeypatch):
    """--tokenizer DIR: the tokenizer and chat template come from another directory."""
    from tandem.cluster.settings import Settings
    from tandem.cluster.tokenizer import load_tokenizer

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    full = make_tiny_checkpoint(tmp_path / "full", "llama")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tmp_path / "full" / name, bare / name)
    settings = Settings(model=str(bare), tokenizer=full, admin_port=0).resolve()
    with pytest.raises(Exception):
        load_tokenizer(settings.model)  # the checkpoint itself has none
    import redis.asyncio as aioredis

    from tandem.gateway.service import GatewayService

    service = GatewayService(settings, redis=aioredis.Redis.from_url("redis://127.0.0.1:1/0"))  # never used here
    assert service.tokenizer.encode("Hello there") == load_tokenizer(full).encode("Hello there")
    assert service.tokenizer.chat_template
