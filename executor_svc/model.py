"""A model directory's identity, torch-free (the stub executor of the benchmarks shares it): the
files a scheduler needs to tokenize, the digest executors of one namespace must agree on, the EOS ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """The files of ``TOKENIZER_FILES`` that ``model_dir`` has, by name."""
    return {n: (model_dir / n).read_bytes() for n in TOKENIZER_FILES if (model_dir / n).exists()}


def digest(files: dict[str, bytes]) -> str:
    """sha256 over config.json and the tokenizer files: what executors of one namespace must share."""
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(name.encode() + b"\0" + data)
    return h.hexdigest()[:32]


def eos_ids(model_dir: Path, config_eos: int | list[int] | None) -> list[int]:
    """generation_config.json's ``eos_token_id`` where that file exists (as transformers'
    ``GenerationConfig`` reads it), else the model config's (``config_eos``)."""
    path = model_dir / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else config_eos
    return sorted({int(v) for v in (eos if isinstance(eos, list) else [eos]) if v is not None})
