"""Request validation (``scheduler_svc.frontend.validate``) on plain data."""

from __future__ import annotations

import pytest

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.core.request import Params
from scheduler_svc.frontend.validate import (
    InvalidArgument,
    Limits,
    OverCapacity,
    check,
    check_length,
)

LIMITS = Limits(max_model_len=100, vocab_size=1000, block_size=16, pools=((4, 100),))


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
