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
    truncated,
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


def _refused(req: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check(req, LIMITS)
    assert info.value.field == field, info.value


def test_vllm_s_chat_template_fields_and_their_refusals() -> None:
    msgs = [pb.ChatMessage(role="user", content="hi")]
    assert check(pb.GenerateRequest(messages=msgs), LIMITS).template.add_generation_prompt
    c = check(pb.GenerateRequest(messages=msgs, continue_final_message=True), LIMITS)
    assert (c.template.add_generation_prompt, c.template.continue_final_message) == (False, True)
    req = pb.GenerateRequest(messages=msgs)
    req.chat_template_kwargs.update({"enable_thinking": False, "n": 2.0, "x": [1.5]})
    assert check(req, LIMITS).template.kwargs == {"enable_thinking": False, "n": 2, "x": [1.5]}
    _refused(
        pb.GenerateRequest(messages=msgs, add_generation_prompt=True, continue_final_message=True),
        "continue_final_message",
    )
    _refused(pb.GenerateRequest(prompt="hi", add_generation_prompt=False), "add_generation_prompt")
    req = pb.GenerateRequest(messages=msgs)
    req.chat_template_kwargs.update({"tokenize": True})
    _refused(req, "chat_template_kwargs.tokenize")


def test_token_masks_and_truncation_checks() -> None:
    s = pb.SamplingParams(allowed_token_ids=[5, 3, 5], include_stop_str_in_output=True)
    c = check(pb.GenerateRequest(prompt="hi", sampling=s), LIMITS)
    assert c.params.allowed_token_ids == (3, 5) and c.params.include_stop_str_in_output
    _refused(
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(allowed_token_ids=[1000])),
        "sampling.allowed_token_ids",
    )
    _refused(
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(bad_words=["ok", " "])), "sampling.bad_words[1]"
    )
    _refused(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(bad_words=["w"] * 65)), "sampling.bad_words")
    _refused(pb.GenerateRequest(prompt="hi", truncate_prompt_tokens=0), "truncate_prompt_tokens")
    _refused(pb.GenerateRequest(prompt_token_ids=[1] * 100), "prompt_token_ids")
    check(pb.GenerateRequest(prompt_token_ids=[1] * 100, truncate_prompt_tokens=10), LIMITS)  # truncated later
    prompt = list(range(120))
    assert truncated(prompt, None, Params(), LIMITS) == prompt
    assert truncated(prompt, 5, Params(), LIMITS) == prompt[-5:]
    assert truncated(prompt, -1, Params(max_tokens=10), LIMITS) == prompt[-90:], "-1: max_model_len - max_tokens"
    with pytest.raises(InvalidArgument, match="truncate_prompt_tokens"):
        truncated(prompt, 95, Params(max_tokens=10), LIMITS)
