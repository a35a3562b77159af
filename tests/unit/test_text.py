"""Request validation and incremental detokenization, with SmolLM2's real tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.core.request import Params
from scheduler_svc.frontend.detok import Detokenizer
from scheduler_svc.frontend.validate import (
    InvalidArgument,
    Limits,
    OverCapacity,
    check,
    check_length,
)

LIMITS = Limits(max_model_len=100, vocab_size=1000, block_size=16, pools=((4, 100),))


@pytest.fixture(scope="module")
def tok(smol_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(smol_dir)


def test_unset_sampling_fields_take_vllm_defaults() -> None:
    c = check(pb.GenerateRequest(prompt="hi"), LIMITS)
    assert c.params == Params(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None)
    c = check(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=0, seed=0)), LIMITS)
    assert c.params.temperature == 0.0 and c.params.seed == 0


def test_length_and_capacity_checks() -> None:
    with pytest.raises(InvalidArgument, match="prompt"):
        check_length("prompt", 100, Params(max_tokens=1), LIMITS)
    with pytest.raises(OverCapacity, match="max_tokens"):
        check_length("prompt", 60, Params(max_tokens=10), LIMITS)  # 70 tokens: 5 blocks > 4
    check_length("prompt", 60, Params(max_tokens=4), LIMITS)  # 64 tokens: exactly 4 blocks


def test_a_request_must_fit_one_executor_whole() -> None:
    """Two pools: one with a short context, a larger one with a long context."""
    two = Limits(max_model_len=200, vocab_size=1000, block_size=16, pools=((8, 100), (10, 200)))
    check_length("prompt", 60, Params(max_tokens=60), two)  # 120 -> capped at 100 tokens: 7 blocks on the first
    check_length("prompt", 120, Params(max_tokens=4), two)  # 124 tokens: 8 blocks, only the second's context
    with pytest.raises(OverCapacity, match="largest executor pool has 10"):
        check_length("prompt", 150, Params(max_tokens=30), two)  # too long for the first, too big for the second


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
