"""Tool calling, the output side (scheduler_svc/frontend/tool_calls.py): calls read from text, whole or streamed,
and OpenAI's shapes of them in scheduler_svc/frontend/openai_response.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend import openai_request, tool_calls
from scheduler_svc.frontend.openai_response import Collected, Shape
from scheduler_svc.frontend.streams import Chunk
from scheduler_svc.frontend.tool_calls import Call, read_all
from scheduler_svc.frontend.tools import Plan

AUTO = Plan("auto", parser="hermes")
REQUIRED = Plan("required")
NAMED = Plan("named", function="get_weather")
TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def named(calls: list[Call]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(plan: Plan, pieces: list[str], clean: bool = True) -> tuple[str, list[Call]]:
    r = tool_calls.reader(plan)
    assert r is not None
    content, calls = "", []
    for piece in pieces:
        text, found = r.feed(piece)
        assert not clean or ("<tool_c" not in text and "</tool" not in text), "no tag leaks into a content delta"
        content, calls = content + text, calls + found
    text, found = r.finish()
    return content + text, calls + found


def test_hermes_reads_each_call_and_keeps_the_rest_as_content() -> None:
    content, calls = read_all(AUTO, TWO)
    assert content == "Let me check."
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    as_text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'  # arguments as JSON text
    assert named(read_all(AUTO, as_text)[1]) == [("f", {"x": 1})]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_a_stream_in_any_pieces_reads_what_the_whole_text_reads(size: int) -> None:
    want = read_all(AUTO, TWO)
    content, calls = streamed(AUTO, [TWO[i : i + size] for i in range(0, len(TWO), size)])
    assert content == want[0] and named(calls) == named(want[1])


def test_text_that_does_not_parse_stays_content() -> None:
    for text in (
        "Plain answer, no call.",
        "<tool_call>not json</tool_call> after",
        'a <tool_call>{"arguments": {}}</tool_call>',  # no name
        "a < b and <tool but not a tag",
    ):
        assert read_all(AUTO, text) == (text.strip(), []), text
        assert streamed(AUTO, list(text), clean=False) == (text.strip(), []), text


def test_an_unclosed_call_at_the_end_is_read_as_vllm_reads_it() -> None:
    content, calls = read_all(AUTO, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert content is None and named(calls) == [("f", {"x": 1})]
    cut = '<tool_call>\n{"name": "f", "argu'
    assert read_all(AUTO, cut) == (cut, [])


def test_without_parallel_tool_calls_only_the_first_call() -> None:
    one = Plan("auto", parser="hermes", parallel=False)
    assert [c.name for c in read_all(one, TWO)[1]] == ["get_weather"]
    assert [c.name for c in streamed(one, list(TWO))[1]] == ["get_weather"]


def test_required_and_named_read_the_grammars_json() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = read_all(REQUIRED, text)
    assert content is None and named(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert streamed(REQUIRED, list(text))[0] == "" and named(streamed(REQUIRED, list(text))[1]) == named(calls)
    content, calls = read_all(NAMED, '{"city": "Paris"}')
    assert content is None and named(calls) == [("get_weather", {"city": "Paris"})]
    content, cut = read_all(NAMED, '{"city": "Pa')
    assert content is None and [(c.name, c.arguments) for c in cut] == [("get_weather", '{"city": "Pa')], (
        "cut short (length): still the call's arguments, as vLLM (and as a stream sent them)"
    )
    assert read_all(NAMED, "") == ("", [])
    assert read_all(None, "text") == ("text", []) and read_all(Plan("none"), " text ") == (" text ", [])


def test_finish_reason_is_tool_calls_only_when_calls_ended_the_completion() -> None:
    assert tool_calls.finish_reason("stop", 1) == "tool_calls"
    assert tool_calls.finish_reason("length", 1) == "length" and tool_calls.finish_reason("stop", 0) == "stop"


def shape(plan: Plan | None, stream: bool) -> Shape:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return Shape(openai_request.parse(body, chat=True), "r", 0, "m", [[1, 2]], tools=plan)


def test_openai_shapes_of_calls_whole_and_streamed() -> None:
    done = Collected()
    done.add(Chunk("r", [5, 6], TWO, 0, "stop", 2, 2))
    choice = shape(AUTO, False).body([done])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}

    s = shape(AUTO, True)
    pieces = [TWO[i : i + 4] for i in range(0, len(TWO), 4)]
    events = [e for i, p in enumerate(pieces) for e in s.events(Chunk("r", [i], p, i, "stop" * (i == len(pieces) - 1)))]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed_calls] == [0, 1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_grpc_door_puts_the_calls_on_the_last_message() -> None:
    texts = tool_calls.Texts(NAMED)
    first = texts.annotate(pb.GenerateResponse(text='{"city": '))
    last = texts.annotate(pb.GenerateResponse(text='"Paris"}', finish_reason="stop"))
    assert not first.tool_calls and [(c.name, c.arguments) for c in last.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert not tool_calls.Texts(None).annotate(pb.GenerateResponse(text="x", finish_reason="stop")).tool_calls


def test_a_named_functions_arguments_stream_as_they_come() -> None:
    s = shape(NAMED, True)
    pieces = ['{"ci', 'ty": ', '"Paris"}']
    events = [e for i, p in enumerate(pieces) for e in s.events(Chunk("r", [i], p, i, "stop" * (i == 2)))]
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(e["choices"][0]["delta"].get("content") for e in events)
