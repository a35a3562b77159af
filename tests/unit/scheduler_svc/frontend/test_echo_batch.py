"""``echo`` and batched prompts on plain data (``scheduler_svc.frontend.echo``, ``batch`` and the
answers ``openai_response.Shape`` builds with them). No processes, no I/O."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from scheduler_svc.frontend import batch, echo
from scheduler_svc.frontend import openai_request as proto
from scheduler_svc.frontend import openai_response as answer
from scheduler_svc.frontend.streams import Chunk
from tests.unit.scheduler_svc.frontend.test_openai_request import M, completion
from tests.unit.scheduler_svc.frontend.test_openai_response import LP_CHUNKS

DECODE = {1: "<s>", 2: "a", 3: "b", 4: "c", 9: "x", 10: "Hel", 11: "", 12: "lo"}


def _echo_shape(body: dict[str, Any], prompts: list[list[int]], texts: tuple[str, ...]) -> answer.Shape:
    body, on = echo.read(body, chat=False)
    assert on is not None
    return answer.Shape(
        proto.parse(body, chat=False), "rid", 1700, M, prompts, DECODE.__getitem__, dataclasses.replace(on, texts=texts)
    )


def test_echo_reads_max_tokens_0_as_the_prompt_alone() -> None:
    body, on = echo.read(completion(echo=True, max_tokens=0, logprobs=2), chat=False)
    assert on == echo.Echo(only=True) and body["max_tokens"] == 1 and body["prompt_logprobs"] == 2
    assert echo.read(completion(echo=True, logprobs=1, prompt_logprobs=3), chat=False)[0]["prompt_logprobs"] == 3
    assert echo.read(completion(echo=False, max_tokens=0), chat=False) == (completion(echo=False, max_tokens=0), None)
    for body, chat in [(completion(echo="yes"), False), ({"model": M, "messages": [], "echo": True}, True)]:
        with pytest.raises(proto.ApiError) as info:
            echo.read(body, chat)
        assert info.value.status == 400 and info.value.param == "echo"


def test_echo_puts_the_prompt_and_its_logprobs_first() -> None:
    shape = _echo_shape(completion(echo=True, logprobs=2), [[1, 2, 3]], ("<s>ab",))
    done = answer.Collected()
    for c in LP_CHUNKS:
        done.add(c)
    choice = shape.body([done])["choices"][0]
    assert choice["text"] == "<s>abHello"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<s>", "a", "b", "Hel", "", "lo"]
    assert lp["token_logprobs"] == [None, -3.0, -2.0, -0.5, -0.25, -0.125]
    assert lp["top_logprobs"][:3] == [None, {"x": -0.1, "a": -3.0}, {"b": -2.0}]
    assert lp["text_offset"] == [0, 3, 4, 5, 8, 8]
    streamed = _echo_shape(completion(echo=True, logprobs=2, stream=True), [[1, 2, 3]], ("<s>ab",))
    events = [e for c in LP_CHUNKS for e in streamed.events(c)]
    assert "".join(e["choices"][0]["text"] for e in events) == "<s>abHello"
    assert [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]


def test_echo_with_max_tokens_0_answers_the_prompt_alone() -> None:
    body = completion(echo=True, max_tokens=0, logprobs=0, stream=True, stream_options={"include_usage": True})
    streamed = _echo_shape(body, [[1, 2, 3]], ("<s>ab",))
    events = [e for c in LP_CHUNKS for e in streamed.events(c)] + streamed.closing()
    assert len(events) == 2 and events[0]["choices"][0]["text"] == "<s>ab"
    assert events[0]["choices"][0]["finish_reason"] == "length"
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -3.0, -2.0]
    assert events[1]["usage"]["completion_tokens"] == 0 and events[1]["usage"]["prompt_tokens"] == 3


def test_a_streamed_echo_choice_waits_for_its_prompt_s_logprobs() -> None:
    """With n = 2 only completion 0 brings the prompt's logprobs; completion 1 may come first."""
    shape = _echo_shape(completion(echo=True, logprobs=1, n=2, stream=True), [[1, 2, 3]], ("<s>ab",))
    early = dataclasses.replace(LP_CHUNKS[1], index=1, offset=0, text="lo")
    assert shape.events(early) == []
    events = shape.events(LP_CHUNKS[0])
    assert [e["choices"][0]["index"] for e in events] == [0, 1]
    assert [e["choices"][0]["text"] for e in events] == ["<s>abHel", "<s>ablo"]
    assert events[1]["choices"][0]["logprobs"]["token_logprobs"] == [None, -3.0, -2.0, -0.25]


def test_a_batch_numbers_choices_by_prompt_and_adds_up_usage() -> None:
    shape = answer.Shape(proto.parse(completion(n=2, return_token_ids=True), chat=False), "b", 1700, M, [[1], [2, 3]])
    done = []
    for i in range(4):
        d = answer.Collected()
        d.add(Chunk(f"b-{i // 2}", [10 + i], f"t{i}", 0, "length", 1 + i // 2, 1, cached_tokens=i // 2, index=i % 2))
        done.append(d)
    body = shape.body(done)
    assert [(c["index"], c["text"], c["prompt_token_ids"]) for c in body["choices"]] == [
        (0, "t0", [1]),
        (1, "t1", [1]),
        (2, "t2", [2, 3]),
        (3, "t3", [2, 3]),
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_batch_prompts_and_their_names() -> None:
    assert batch.prompts("a") is None and batch.prompts([1, 2]) is None and batch.prompts(["a"]) is None
    assert batch.prompts(["a", [1, 2]]) == ["a", [1, 2]]
    with pytest.raises(proto.ApiError):
        batch.prompts(["a"] * (batch.MAX_PROMPTS + 1))
    err = batch.renamed(proto.bad("prompt[3]", "must be an integer"), 1)
    assert (err.param, err.message) == ("prompt[1][3]", "prompt[1][3]: must be an integer")
    kept = proto.bad("prompt_logprobs", "no")
    assert batch.renamed(kept, 1) is kept


async def _chunks(*cs: Chunk) -> Any:
    for c in cs:
        yield c


def test_numbered_renumbers_by_prompt() -> None:
    import asyncio

    async def go() -> list[int]:
        cs = [Chunk("b-1", [], "", 0, index=1), Chunk("b-0", [], "", 0, index=0)]
        return [c.index async for c in batch.numbered(_chunks(*cs), {"b-0": 0, "b-1": 1}, 2)]

    assert asyncio.run(go()) == [3, 0]
