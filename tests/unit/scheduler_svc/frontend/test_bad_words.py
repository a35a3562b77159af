"""vLLM's bad_words as token sequences (``frontend.bad_words``), with SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scheduler_svc.frontend.bad_words import sequences
from scheduler_svc.frontend.refusals import InvalidArgument


@pytest.fixture(scope="module")
def tok(smol_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(smol_dir)


def test_each_word_as_written_and_after_a_space(tok) -> None:  # noqa: ANN001
    enc = lambda text: tuple(tok.encode(text, add_special_tokens=False))  # noqa: E731
    assert sequences(tok, ["Paris"], tok.vocab_size) == (enc("Paris"), enc(" Paris"))
    # leading spaces are stripped first, as vLLM does: " Paris" bans the same
    assert sequences(tok, [" Paris"], tok.vocab_size) == (enc("Paris"), enc(" Paris"))
    two = sequences(tok, ["big cat"], tok.vocab_size)
    assert two[0] == enc("big cat") and all(len(s) == len(two[0]) for s in two)
    with pytest.raises(InvalidArgument) as info:
        sequences(tok, ["ok", "Paris"], 100)  # a tokenizer whose ids exceed the model's vocabulary
    assert info.value.field == "sampling.bad_words[0]"
