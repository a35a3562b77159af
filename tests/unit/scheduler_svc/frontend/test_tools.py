"""Tool calling, the request side (scheduler_svc/frontend/tools.py): plain data in, plans and template input out."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend import openai_request, tools
from scheduler_svc.frontend.refusals import InvalidArgument
from scheduler_svc.frontend.validate import Caps, Limits, check

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any empty object


def request(**body: Any) -> pb.GenerateRequest:
    """A chat body through the HTTP door's parser (tools.from_openai included)."""
    msgs = body.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return openai_request.parse({"model": "m", "messages": msgs, **body}, chat=True).request


def test_openai_tools_become_pagedserve_messages_and_back_unchanged() -> None:
    req = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [t.name for t in req.tools] == ["get_weather", "get_time"]
    assert req.tool_choice.function_name == "get_time" and not req.HasField("parallel_tool_calls")
    p = tools.plan(req)
    assert p is not None and p.mode == "named" and p.function == "get_time"
    # The template sees what the client sent, in its order (the order the model writes the arguments in).
    assert p.tools[0] == WEATHER and json.dumps(p.tools[0]) == json.dumps(WEATHER)
    assert p.tools[1] == {"type": "function", "function": {"name": "get_time", "parameters": tools.NO_PARAMETERS}}
    assert p.schema is not None and json.loads(p.schema) == tools.NO_PARAMETERS


def test_modes_and_their_defaults() -> None:
    assert tools.plan(request()) is None
    assert tools.plan(request(tool_choice="auto")) is None, "auto without tools calls nothing"
    assert tools.plan(request(tool_choice="none")) is None
    none = tools.plan(request(tools=[WEATHER], tool_choice="none"))
    assert none is not None and none.mode == "none" and none.schema is None and none.tools
    auto = tools.plan(request(tools=[WEATHER]), parser="hermes")
    assert auto is not None and auto.mode == "auto" and auto.parser == "hermes" and auto.schema is None


def test_required_is_vllms_schema_and_admits_only_the_tools_calls() -> None:
    p = tools.plan(request(tools=[WEATHER, TIME], tool_choice="required"))
    assert p is not None and p.mode == "required" and p.schema is not None
    schema = json.loads(p.schema)
    assert schema == tools.required_schema(list(p.tools), parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"days": 2}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = tools.plan(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    assert one is not None and one.schema is not None
    assert json.loads(one.schema)["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, json.loads(one.schema))


def test_pydantic_defs_are_hoisted_to_the_root() -> None:
    nested = {
        "type": "function",
        "function": {
            "name": "save",
            "parameters": {
                "$defs": {"Author": {"type": "object", "properties": {"name": {"type": "string"}}}},
                "type": "object",
                "properties": {"author": {"$ref": "#/$defs/Author"}},
                "required": ["author"],
            },
        },
    }
    p = tools.plan(request(tools=[nested], tool_choice="required"))
    assert p is not None and p.schema is not None
    schema = json.loads(p.schema)
    assert "Author" in schema["$defs"] and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "save", "parameters": {"author": {"name": "Ann"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "save", "parameters": {"author": {"name": 3}}}], schema)


@pytest.mark.parametrize(
    "body,parser,field",
    [
        ({"tools": [WEATHER]}, "", "tool_choice"),  # auto without --enable-auto-tool-choice: vLLM's 400
        ({"tool_choice": "required"}, "", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "", "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "none"},
            "",
            "tools[0].name",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "", "tools"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body: dict[str, Any], parser: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        tools.plan(request(**body), parser)
    assert info.value.field == field, info.value


def test_refusals_name_the_fields_as_openai_does() -> None:
    assert tools.openai_name("tools[3].name") == "tools[3].function.name"
    assert tools.openai_name("tools[0].parameters_json_schema") == "tools[0].function.parameters"
    assert tools.openai_name("messages[2].tool_calls[1].arguments") == "messages[2].tool_calls[1].function.arguments"
    assert openai_request.openai_field("tool_choice") == "tool_choice"


def test_tools_need_messages() -> None:
    req = pb.GenerateRequest(prompt="hi", tools=[pb.Tool(name="f")], tool_choice=pb.ToolChoice(mode=pb.ToolChoice.NONE))
    with pytest.raises(InvalidArgument) as info:
        tools.plan(req)
    assert info.value.field == "tools"


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects() -> None:
    req = request(messages=HISTORY, tools=[WEATHER], tool_choice="none")
    messages, given = tools.template_messages(req, tools.plan(req), aware=True)
    assert given == [WEATHER]
    assert messages[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert messages[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}


def test_a_template_blind_to_tools_gets_the_hermes_prompt_and_text() -> None:
    req = request(messages=[{"role": "system", "content": "Be brief."}, *HISTORY], tools=[WEATHER], tool_choice="none")
    messages, given = tools.template_messages(req, tools.plan(req), aware=False)
    assert given is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system and "<tool_call>" in system
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3]["content"] == "<tool_response>\nsunny, 21 C\n</tool_response>"
    alone, _ = tools.template_messages(request(messages=HISTORY), None, aware=False)
    assert alone[0] == HISTORY[0] and "tool_call" in alone[1]["content"], "history without tools: no prompt"


def test_renders_tools_reads_the_template() -> None:
    assert tools.renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not tools.renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tools.renders_tools({"default": "x", "tool_use": "{{ tools }}"}) and not tools.renders_tools(None)


def test_a_call_whose_arguments_are_not_json_is_refused_at_rendering() -> None:
    bad = [HISTORY[0], {**HISTORY[1], "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(InvalidArgument) as info:
        tools.template_messages(request(messages=bad), None, aware=True)
    assert info.value.field == "messages[1].tool_calls[0].arguments"


LIMITS = Limits(max_model_len=100, vocab_size=1000, block_size=16, pools=((4, 100),))


def test_required_and_named_become_the_requests_grammar() -> None:
    req = request(tools=[WEATHER], tool_choice="required")
    checked = check(req, LIMITS)
    assert checked.tools is not None and checked.grammar_field == "tools"
    assert checked.params.grammar == ("json_schema", checked.tools.schema)
    auto = check(request(tools=[WEATHER]), LIMITS, tool_parser="hermes")
    assert auto.params.grammar is None and auto.tools is not None and auto.tools.mode == "auto"
    # auto and none leave another constraint alone: it shapes the text the parser reads
    forced = request(tools=[WEATHER], structured_outputs={"regex": "a+"})
    assert check(forced, LIMITS, tool_parser="hermes").params.grammar == ("regex", "a+")


@pytest.mark.parametrize(
    "body,caps,field",
    [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, Caps(), "tool_choice"),
        ({"tool_choice": "required", "ignore_eos": True}, Caps(), "sampling.ignore_eos"),
        ({"tool_choice": "required"}, Caps(max_grammar_bytes=64), "tools"),
    ],
)
def test_the_tools_grammar_is_refused_where_a_constraint_would_be(body: dict[str, Any], caps: Caps, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check(request(tools=[WEATHER], **body), LIMITS, caps)
    assert info.value.field == field, info.value
