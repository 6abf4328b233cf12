"""Load the model's tokenizer without importing torch.

``transformers.AutoTokenizer`` imports the model configuration machinery,
which imports torch whenever torch is installed (transformers 5). The gateway
must stay torch-free, yet its tokenizer must be the one AutoTokenizer gives: its
rules pick the class from the config's model type, the tokenizer config and
special cases (a checkpoint saved by transformers 5 names the generic
``TokenizersBackend``, and AutoTokenizer then takes ``Qwen2Tokenizer`` for a
Qwen2 model, which splits text differently). So the class name is found by
AutoTokenizer itself, once per checkpoint, in a child process, and cached under
$TANDEM_CACHE/tokenizer-classes/ (keyed by the tokenizer files and transformers'
version); the gateway then loads ``transformers.<that class>``, which imports only
its tokenization module. Where no child can tell, the class ``tokenizer_config.json``
names is used, else the generic ``tokenizers``-backed class; only a checkpoint
with neither goes through ``AutoTokenizer`` in-process, with a warning.

A GGUF checkpoint carries its tokenizer in its metadata. transformers builds it
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``) through its GGUF loader,
which imports torch, so a child process builds it once and saves it, as
tokenizer.json and friends, under $TANDEM_CACHE/gguf-tokenizers/ (keyed by the
file's path, size and mtime and transformers' version); the gateway loads the
saved copy as it loads any checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import structlog

from tandem.cluster.checkpoint import gguf_file
from tandem.cluster.settings import Settings

log = structlog.get_logger(__name__)


def load_tokenizer(model: str):
    """The tokenizer of the local checkpoint directory or GGUF file ``model`` (no downloads)."""
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    gguf_path = gguf_file(model)
    if gguf_path is not None:
        model = gguf_tokenizer_dir(gguf_path)
    path = Path(model)
    class_name = (auto_tokenizer_class(path) if gguf_path is None else None) or _configured_class(path)
    cls = _resolve(transformers, class_name)
    if cls is None and (path / "tokenizer.json").is_file():
        cls = transformers.PreTrainedTokenizerFast
    if cls is None or not issubclass(cls, PreTrainedTokenizerBase):
        log.warning("tokenizer class not resolvable torch-free, using AutoTokenizer", tokenizer_class=class_name)
        return transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
    return cls.from_pretrained(model, local_files_only=True)


TOKENIZER_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json",
                   "tokenizer.model")


def _cache_root() -> Path:
    return Path(Settings.field_default("cache"))


def auto_tokenizer_class(path: Path) -> str | None:
    """The class ``AutoTokenizer.from_pretrained(path)`` returns, found by AutoTokenizer in a child
    process the first time and cached; None if the child could not tell."""
    import transformers

    stamps = []
    for name in TOKENIZER_FILES:
        try:
            stat = (path / name).stat()
        except OSError:
            continue
        stamps.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha256("\0".join([os.path.realpath(path), *stamps, transformers.__version__]).encode()).hexdigest()
    cached = _cache_root() / "tokenizer-classes" / key[:24]
    try:
        return cached.read_text().strip() or None
    except OSError:
        pass
    done = subprocess.run([sys.executable, "-P", "-m", "tandem.cluster.tokenizer", "--auto-class", str(path)],
                          capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        log.warning("AutoTokenizer could not name the tokenizer class", model=str(path), error=last)
        return None
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
    tmp.write_text(lines[-1])
    os.replace(tmp, cached)  # whole or not at all: gateways may start side by side
    return lines[-1]


def gguf_tokenizer_dir(gguf_path: str) -> str:
    """The directory holding the GGUF file's tokenizer as transformers builds it, built on first use."""
    import transformers

    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    # transformers' version too: its conversion of a GGUF vocabulary is what the copy must equal
    key = f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = _cache_root() / "gguf-tokenizers" / f"{Path(real).stem}-{key}"
    if not (out / "tokenizer.json").is_file():
        log.info("building the GGUF file's tokenizer", gguf=real, cache=str(out))
        done = subprocess.run([sys.executable, "-P", "-m", "tandem.cluster.tokenizer", real, str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"building the tokenizer of {real} failed: {last}")
    return str(out)


def _build_gguf_tokenizer(gguf_path: str, out: str) -> None:
    """In a child process (transformers' GGUF reading imports torch): build and save the tokenizer."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                              local_files_only=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(out))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the cache from other users
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, out)  # whole or not at all: another process may be building the same one
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, "tokenizer.json")):
            raise


def vocab_size(tokenizer) -> int:
    """Number of token ids the tokenizer can decode (added tokens included)."""
    return len(tokenizer)


def _configured_class(path: Path) -> str | None:
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def _resolve(transformers, class_name: str | None):
    if not class_name:
        return None
    for name in (class_name, class_name.removesuffix("Fast")):
        try:
            return getattr(transformers, name)
        except (AttributeError, ImportError, RuntimeError):
            continue
    return None


def _print_auto_class(path: str) -> None:
    """In a child process (AutoTokenizer imports torch): the class AutoTokenizer picks for ``path``."""
    from transformers import AutoTokenizer

    print(type(AutoTokenizer.from_pretrained(path, local_files_only=True)).__name__)


if __name__ == "__main__":
    if sys.argv[1] == "--auto-class":
        _print_auto_class(sys.argv[2])
    else:
        _build_gguf_tokenizer(sys.argv[1], sys.argv[2])
