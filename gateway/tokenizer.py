"""Load the model's tokenizer without importing torch.

``transformers.AutoTokenizer`` imports the model configuration machinery,
which imports torch whenever torch is installed (transformers 5). The gateway
must stay torch-free, so we resolve the class ``tokenizer_config.json`` names
ourselves (``transformers.<tokenizer_class>`` loads only its tokenization
module) and fall back to the generic ``tokenizers``-backed class, which reads
``tokenizer.json``. Only a checkpoint that has neither (a slow
SentencePiece-only tokenizer) goes through ``AutoTokenizer``, with a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def load_tokenizer(model: str):
    """The tokenizer of the local checkpoint directory ``model`` (no downloads)."""
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    path = Path(model)
    class_name = _configured_class(path)
    cls = _resolve(transformers, class_name)
    if cls is None and (path / "tokenizer.json").is_file():
        cls = transformers.PreTrainedTokenizerFast
    if cls is None or not issubclass(cls, PreTrainedTokenizerBase):
        log.warning("tokenizer class not resolvable torch-free, using AutoTokenizer", tokenizer_class=class_name)
        return transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
    return cls.from_pretrained(model, local_files_only=True)


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
