"""The executor's unit tests share SmolLM2's real tokenizer and a grammar compiler over it."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedserve.grammar import Compiler

VOCAB, EOS = 49152, 2


@pytest.fixture(scope="module")
def tok(smol_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def compiler(tok: object) -> Compiler:
    return Compiler(tok, VOCAB, [EOS])
