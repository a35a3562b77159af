"""``/v1/responses`` as a chat completion (``scheduler_svc.frontend.responses`` and ``responses_stream``) on plain
data: requests to chat bodies, chat answers and chat stream chunks to Responses and their events, checked against
the ``openai`` SDK's own models (what ``client.responses.create`` parses). Tool round trips are translated in chat's
standard shape (``message.tool_calls``, ``delta.tool_calls``, ``role: tool``). No processes, no I/O."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from scheduler_svc.frontend import openai_request as proto
from scheduler_svc.frontend import openai_response as answer
from scheduler_svc.frontend import responses
from scheduler_svc.frontend.openai_request import ApiError
from scheduler_svc.frontend.responses_stream import Events, encode
from scheduler_svc.frontend.streams import Chunk

M = "tiny"
EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER["parameters"],
        "strict": True,
    },
}


def ids() -> Any:
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{next(counter)}"


def refusal(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as got:
        responses.parse(body)
    assert got.value.status == 400
    return got.value


# --- requests ------------------------------------------------------------------------


def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    call = responses.parse(
        {"model": M, "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0, "top_p": 1}
    )
    body = responses.chat_body(call, [])
    assert body == {
        "model": M,
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 1,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    parsed = proto.parse(body, chat=True)  # what the chat path makes of it
    assert [(m.role, m.content) for m in parsed.request.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert parsed.request.sampling.max_tokens == 7 and not call.stream and call.store


def test_message_items_with_text_parts_and_developer_role() -> None:
    call = responses.parse(
        {
            "model": M,
            "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "b", "annotations": []}],
                },
                {"role": "user", "content": "c"},
            ],
        }
    )
    assert call.messages == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    chat = proto.parse(responses.chat_body(call, []), chat=True).request.messages
    assert [(m.role, m.content) for m in chat] == [
        ("system", "Rules."),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
    ]


def test_function_call_items_become_assistant_tool_calls_and_tool_messages() -> None:
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
            "status": "completed",
        },
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    assert responses.messages(items) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
    ]
    # An assistant's text right before its calls is the same message.
    said = [{"role": "assistant", "content": "Let me look."}, items[1]]
    assert responses.messages(said) == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": responses.messages(items)[1]["tool_calls"][:1]}
    ]


def test_a_function_call_item_becomes_an_assistant_tool_call() -> None:
    body = {"model": M, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}
    assert responses.parse(body).messages[0]["tool_calls"][0]["id"] == "c"


def test_tools_tool_choice_and_text_format_in_chat_shape() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    call = responses.parse(
        {
            "model": M,
            "input": "x",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
        }
    )
    assert call.chat["tools"] == [CHAT_WEATHER]
    assert call.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert call.chat["parallel_tool_calls"] is False
    assert call.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    assert call.echo["tools"] == [WEATHER] and call.echo["parallel_tool_calls"] is False
    plain = responses.parse({"model": M, "input": "x", "tools": [], "parallel_tool_calls": True, "tool_choice": "auto"})
    assert "tools" not in plain.chat and "parallel_tool_calls" not in plain.chat and plain.chat["tool_choice"] == "auto"
    assert (
        responses.parse({"model": M, "input": "x", "text": {"format": {"type": "text"}}}).chat.get("response_format")
        is None
    )
    streamed = responses.parse({"model": M, "input": "x", "stream": True})
    assert streamed.stream and streamed.chat["stream_options"] == {"include_usage": True}


def test_history_comes_after_the_instructions_and_before_the_input() -> None:
    call = responses.parse({"model": M, "input": "again", "instructions": "new"})
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert responses.chat_body(call, history)["messages"] == [
        {"role": "system", "content": "new"},
        *history,
        {"role": "user", "content": "again"},
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning", {"effort": "high"}),
        ("background", True),
        ("include", ["reasoning.encrypted_content"]),
        ("truncation", "auto"),
        ("conversation", "conv_1"),
        ("prompt", {"id": "pmpt_1"}),
        ("top_logprobs", 3),
        ("max_tool_calls", 2),
    ],
)
def test_fields_not_honoured_are_refused_naming_them(field: str, value: Any) -> None:
    err = refusal({"model": M, "input": "x", field: value})
    assert err.param == field and err.message.startswith(f"{field}: ")


def test_off_values_of_refused_fields_are_accepted() -> None:
    """What clients send by default (the Agents SDK: ``include: []``) is no refusal."""
    off = {"include": [], "reasoning": {"effort": None, "summary": None}, "truncation": "disabled", "background": False}
    assert responses.parse({"model": M, "input": "x", **off}).chat == {"model": M}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
        ({"input": None}, "input"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"stream": "yes"}, "stream"),
        ({"metadata": [1]}, "metadata"),
    ],
)
def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    assert refusal({"model": M, "input": "x"} | body).param == param


def test_chat_refusals_are_renamed_to_responses_fields() -> None:
    def chat_error(param: str) -> ApiError:
        return proto.bad(param, "must be between 1 and 5")

    for chat_param, want in [
        ("max_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("messages[2].content", "input.content"),
        ("tools[1].function.parameters", "tools[1].parameters"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("temperature", "temperature"),
    ]:
        got = responses.renamed(chat_error(chat_param))
        assert (got.param, got.message) == (want, f"{want}: must be between 1 and 5")
    # The chat path's own refusal of a too large max_tokens, as the door would answer it.
    with pytest.raises(ApiError) as err:
        proto.parse(responses.chat_body(responses.parse({"model": M, "input": "x", "max_output_tokens": 0}), []), True)
    assert responses.renamed(err.value).param == "max_output_tokens"


# --- answers -----------------------------------------------------------------------------


def chat_answer(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-r",
        "object": "chat.completion",
        "created": 1700,
        "model": M,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": answer.usage(5, 3, 2),
    }


def test_a_text_answer_is_a_response_the_sdk_parses() -> None:
    call = responses.parse({"model": M, "input": "x", "instructions": "I", "metadata": {"k": "v"}})
    got = responses.answer(call, chat_answer({"role": "assistant", "content": "Hello"}, "stop"), "resp_1", ids())
    assert got["output"] == [
        {
            "type": "message",
            "id": "msg_0",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}],
        }
    ]
    assert got["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    parsed = Response.model_validate(got)
    assert parsed.output_text == "Hello" and parsed.status == "completed" and parsed.incomplete_details is None
    assert (parsed.id, parsed.created_at, parsed.model, parsed.instructions) == ("resp_1", 1700, M, "I")
    assert parsed.metadata == {"k": "v"} and parsed.tool_choice == "auto" and parsed.parallel_tool_calls


def test_length_is_incomplete_at_max_output_tokens() -> None:
    call = responses.parse({"model": M, "input": "x", "max_output_tokens": 3})
    got = Response.model_validate(
        responses.answer(call, chat_answer({"role": "assistant", "content": "abc"}, "length"), "r")
    )
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens" and got.output[0].status == "incomplete"
    assert got.max_output_tokens == 3


def test_tool_calls_become_function_call_items() -> None:
    call = responses.parse({"model": M, "input": "x", "tools": [WEATHER]})
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
        ],
    }
    got = responses.answer(call, chat_answer(message, "tool_calls"), "resp_1", ids())
    assert got["output"] == [
        responses.call_item("fc_0", "call_a", "get_weather", '{"city":"Paris"}', "completed"),
        responses.call_item("fc_1", "call_b", "get_weather", '{"city":"Rome"}', "completed"),
    ]
    parsed = Response.model_validate(got)
    assert [o.type for o in parsed.output] == ["function_call", "function_call"] and parsed.tools[
        0
    ].name == "get_weather"
    # The round trip: the output items, fed back with their results, are the chat history again.
    back = responses.messages([*got["output"], {"type": "function_call_output", "call_id": "call_a", "output": "sun"}])
    assert back[0] == message and back[1] == {"role": "tool", "tool_call_id": "call_a", "content": "sun"}
    assert responses.conversation(call, [], got) == [{"role": "user", "content": "x"}, message]


# --- streams -------------------------------------------------------------------------------


def events_of(call: responses.Call, chunks: list[dict[str, Any]]) -> tuple[Events, list[dict[str, Any]]]:
    events = Events(call, "resp_1", 1700, M, ids())
    out = events.opening()
    for c in chunks:
        out += events.feed(c)
    return events, out + events.closing()


def chat_stream(body: dict[str, Any], chunks: list[Chunk]) -> list[dict[str, Any]]:
    """The chat path's stream objects for these frontend chunks (openai_response.Shape's)."""
    shape = answer.Shape(proto.parse(body, chat=True), "r", 1700, M, [[1, 2, 3]])
    out = shape.opening()
    for c in chunks:
        out += shape.events(c)
    return out + shape.closing()


def test_a_text_stream_has_openais_events_and_ends_as_the_whole_answer() -> None:
    call = responses.parse({"model": M, "input": "x", "stream": True})
    chunks = [Chunk("r", [10], "Hel", 0), Chunk("r", [11], "", 1), Chunk("r", [12], "lo", 2, "stop", 3, 3)]
    events, out = events_of(call, chat_stream(responses.chat_body(call, []), chunks))
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    parsed = [EVENT.validate_python(e) for e in out]  # every event is one the SDK knows
    assert "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta") == "Hello"
    assert {(e["item_id"], e["output_index"]) for e in out if "item_id" in e} == {("msg_0", 0)}
    final = parsed[-1].response  # type: ignore[union-attr]
    assert final.output_text == "Hello" and final.status == "completed" and final.usage.total_tokens == 6
    whole = responses.answer(
        call,
        chat_answer({"role": "assistant", "content": "Hello"}, "stop") | {"usage": answer.usage(3, 3)},
        "resp_1",
        ids(),
    )
    assert out[-1]["response"] == whole == events.response()
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    assert encode(out[4]) == (
        b"event: response.output_text.delta\ndata: "
        b'{"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_0","output_index":0,'
        b'"content_index":0,"delta":"Hel","logprobs":[]}\n\n'
    )


def test_a_stream_cut_by_length_ends_incomplete() -> None:
    call = responses.parse({"model": M, "input": "x", "stream": True, "max_output_tokens": 1})
    _, out = events_of(call, chat_stream(responses.chat_body(call, []), [Chunk("r", [10], "Hi", 0, "length", 3, 1)]))
    assert out[-1]["type"] == "response.incomplete" and out[-1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert out[-2]["item"]["status"] == "incomplete"


def test_an_empty_stream_still_has_its_message_item() -> None:
    call = responses.parse({"model": M, "input": "x", "stream": True})
    _, out = events_of(call, chat_stream(responses.chat_body(call, []), [Chunk("r", [2], "", 0, "stop", 3, 1)]))
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert "response.output_text.delta" not in [e["type"] for e in out]


def test_streamed_tool_calls_become_function_call_items() -> None:
    """Chat's standard tool-call deltas (as the tools branch streams them): text, then two calls."""
    call = responses.parse({"model": M, "input": "x", "stream": True, "tools": [WEATHER]})

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def tc(i: int, args: str, call_id: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"index": i, "function": {"arguments": args}}
        if call_id:
            d |= {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}
        return chunk({"tool_calls": [d]})

    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Checking."}),
        tc(0, "", "call_a"),
        tc(0, '{"city":'),
        tc(0, '"Paris"}'),
        tc(1, '{"city":"Rome"}', "call_b"),
        chunk({}, "tool_calls"),
        {"object": "chat.completion.chunk", "choices": [], "usage": answer.usage(4, 9)},
    ]
    _, out = events_of(call, chunks)
    for e in out:
        EVENT.validate_python(e)
    kinds = [e["type"] for e in out]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(out[-1]["response"])
    assert final.output_text == "Checking." and final.status == "completed"
    calls = [(o.call_id, o.arguments, o.id) for o in final.output if o.type == "function_call"]
    assert calls == [("call_a", '{"city":"Paris"}', "fc_1"), ("call_b", '{"city":"Rome"}', "fc_2")]
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.added"] == [0, 1, 2]
