"""Incremental detokenization (``scheduler_svc.frontend.detok``), with SmolLM2's real tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scheduler_svc.frontend.detok import Detokenizer


@pytest.fixture(scope="module")
def tok(smol_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_equals_full_decode(tok, seed: int) -> None:  # noqa: ANN001
    text = "Grüße aus Zürich! 東京タワー 🚀🔥 naïve café — ½ ∑ 👩‍👩‍👧"
    ids = tok(text).input_ids
    rng = random.Random(seed)
    ids = ids + [rng.randrange(0, tok.vocab_size) for _ in range(40)]
    d = Detokenizer(tok)
    pieces = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        d.add(ids[i : i + n])
        pieces.append(d.take(final=False))
        i += n
    pieces.append(d.take(final=True))
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces[:3])


def test_stop_string_is_trimmed_and_never_streamed(tok) -> None:  # noqa: ANN001
    ids = tok(" The quick brown fox jumps over the lazy dog").input_ids
    d = Detokenizer(tok, stop=["fox jumps"])
    streamed = []
    for t in ids:
        accepted = d.add([t])
        streamed.append(d.take(final=d.stopped))
        if d.stopped:
            break
    assert d.stopped and accepted
    text = "".join(streamed)
    assert text == " The quick brown "
    assert "fox" not in "".join(streamed[:-1])
    assert d.add([5]) == [], "nothing is accepted after the stop"


def test_include_stop_keeps_the_stop_string_and_cuts_after_it(tok) -> None:  # noqa: ANN001
    ids = tok(" The quick brown fox jumps over the lazy dog").input_ids
    d = Detokenizer(tok, stop=["jumps", "fox ju"], include_stop=True)
    streamed = []
    for t in ids:
        d.add([t])
        streamed.append(d.take(final=d.stopped))
        if d.stopped:
            break
    assert d.stopped and "".join(streamed) == " The quick brown fox ju", "the earliest match, included"
