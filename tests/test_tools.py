"""Tool calling on one real deployment of tiny Llama (real Redis, gRPC and the scheduler's uvicorn, started with
``--enable-auto-tool-choice --tool-call-parser hermes``) through the official ``openai`` client, LangChain's
``ChatOpenAI``, litellm and the gRPC API.

The model is random: it calls tools only because ``tool_choice`` required or a named function constrains its
output to the tools' JSON (the executor's grammar, which works with any model), and, for ``auto``, because a
structured-output choice makes it write a Hermes ``<tool_call>`` block that the parser reads; left free, its text
stays content. Its chat template (SmolLM2's) ignores tools, so the tools reach it in the built-in Hermes prompt.
Greedy tool-constrained output is token-identical over HTTP, streamed or not, and over gRPC, where the same
constraint is the plain JSON schema vLLM builds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import free_port
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import make_cluster
from tests.helpers import run_all

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather forecast of a city.", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with make_cluster(
        tiny_llama,
        redis_url,
        "tools",
        tmp_path_factory.mktemp("logs"),
        blocks=64,
        http_port=free_port(),
        scheduler_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> str:
    return tiny_llama.name


def chat(client: openai.OpenAI, model: str, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 120}
    return client.chat.completions.create(**(args | kw))


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def reassembled(client: openai.OpenAI, model: str, **kw: Any) -> tuple[Any, str | None]:
    """A streamed answer put together by the openai SDK's own stream helper, and the last chunk's finish reason."""
    args: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 120}
    with client.chat.completions.stream(**(args | kw)) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    return final.choices[0].message, final.choices[0].finish_reason


def test_required_calls_a_tool_with_arguments_that_match_its_schema(client: openai.OpenAI, model: str) -> None:
    got = chat(client, model, tool_choice="required", parallel_tool_calls=False)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, args)] = calls_of(choice.message)
    assert name in ("get_weather", "get_time")
    jsonschema.validate(args, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name])
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    message, finish = reassembled(client, model, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and calls_of(message) == calls_of(choice.message), "streamed = whole (greedy)"


def test_a_named_function_is_called_streamed_or_not(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    got = chat(client, model, tool_choice=named)
    [(name, args)] = calls_of(got.choices[0].message)
    assert name == "get_weather" and got.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(args, WEATHER_PARAMS)
    message, _ = reassembled(client, model, tool_choice=named)
    assert calls_of(message) == [(name, args)]
    chunks = list(chat(client, model, tool_choice=named, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas), "no JSON leaks into content"
    first, *more = [c for d in deltas for c in d.tool_calls or []]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "get_weather"
    assert more and all(c.index == 0 and c.id is None and c.function.name is None for c in more), "arguments stream"
    assert json.loads("".join(c.function.arguments or "" for c in [first, *more])) == args


def test_openai_parse_with_a_pydantic_function_tool(client: openai.OpenAI, model: str) -> None:
    class Forecast(pydantic.BaseModel):
        city: Literal["Paris", "Rome"]
        days: int = pydantic.Field(ge=1, le=7)

    got = client.chat.completions.parse(
        model=model,
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    [call] = got.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Forecast)


def test_auto_reads_hermes_calls_and_leaves_plain_text_as_content(client: openai.OpenAI, model: str) -> None:
    """A structured-output choice makes the random model write a Hermes block; auto's parser reads it."""
    forced = {"structured_outputs": {"choice": ["Let me look.\n" + HERMES_CALL]}}
    got = chat(client, model, extra_body=forced)
    choice = got.choices[0]
    assert choice.message.content == "Let me look." and choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("get_time", {"tz": "CET"})]
    message, finish = reassembled(client, model, extra_body=forced)
    assert message.content == "Let me look." and calls_of(message) == calls_of(choice.message)
    assert finish == "tool_calls"
    chunks = list(chat(client, model, extra_body=forced, stream=True))
    assert all("<tool" not in (c.choices[0].delta.content or "") for c in chunks if c.choices), "no tag leaks"

    free = chat(client, model, max_tokens=12)
    assert not free.choices[0].message.tool_calls and free.choices[0].message.content
    none = chat(client, model, tool_choice="none", extra_body=forced)
    assert not none.choices[0].message.tool_calls and HERMES_CALL in (none.choices[0].message.content or "")


def test_a_history_with_calls_and_tool_results_is_rendered(
    client: openai.OpenAI, model: str, tiny_llama: Path, cluster: Cluster
) -> None:
    """SmolLM2's template ignores tools: the Hermes prompt carries them, and the history's call and result are
    rendered as its text; /tokenize renders the same prompt."""
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=history,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        temperature=0,
        max_tokens=4,
        extra_body={"return_token_ids": True},
    )
    ids = json.loads(raw.text)["prompt_token_ids"]
    prompt = AutoTokenizer.from_pretrained(tiny_llama).decode(ids)
    assert "<tools>\n" + json.dumps(WEATHER) in prompt and json.dumps(TIME) in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "celsius"}}' in prompt
    )
    assert "<|im_start|>tool\n<tool_response>\nSunny, 21 C.\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    import httpx

    tokenized = httpx.post(
        f"{cluster.http_url}/tokenize", json={"model": model, "messages": history, "tools": TOOLS}, timeout=60
    )
    assert tokenized.json()["tokens"] == ids


def test_tool_constrained_output_over_http_equals_the_json_schema_over_grpc(
    client: openai.OpenAI, model: str, cluster: Cluster
) -> None:
    """vLLM's grammar of tool_choice required, written out here, sent over gRPC with the prompt HTTP rendered."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
        extra_body={"return_token_ids": True},
    )
    body = json.loads(raw.text)
    ids, tokens = body["prompt_token_ids"], body["choices"][0]["token_ids"]
    schema = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": t["function"]["parameters"],
                    },
                    "required": ["name", "parameters"],
                }
                for t in TOOLS
            ],
        },
        "maxItems": 1,  # parallel_tool_calls false
    }
    sampling = pb.SamplingParams(
        max_tokens=120, temperature=0, structured_output=pb.StructuredOutput(json_schema=json.dumps(schema))
    )
    plain = run_all(cluster.address, [pb.GenerateRequest(prompt_token_ids=ids, sampling=sampling)])[0]
    assert plain.token_ids == tokens
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in body["choices"][0]["message"]["tool_calls"]
    ]
    assert calls == [(c["name"], c["parameters"]) for c in json.loads(plain.text)]

    # The gRPC API's own tool messages: the same tokens, and the calls on the last message.
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in MESSAGES],
        tools=[
            pb.Tool(
                name=t["function"]["name"],
                description=t["function"]["description"],
                parameters_json_schema=json.dumps(t["function"]["parameters"]),
            )
            for t in TOOLS
        ],
        tool_choice=pb.ToolChoice(mode=pb.ToolChoice.REQUIRED),
        parallel_tool_calls=False,
        sampling=pb.SamplingParams(max_tokens=120, temperature=0),
    )
    with grpc.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
        responses = list(pb_grpc.GenerationStub(ch).Generate(req, timeout=300))
        assert [t for r in responses for t in r.token_ids] == tokens
        assert [(c.name, json.loads(c.arguments)) for c in responses[-1].tool_calls] == calls
        assert not any(r.tool_calls for r in responses[:-1])
        bad = pb.GenerateRequest(
            messages=req.messages, tools=req.tools, tool_choice=pb.ToolChoice(function_name="nope")
        )
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationStub(ch).Generate(bad, timeout=300))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("tool_choice:")


def test_bad_tools_are_400_naming_the_field(client: openai.OpenAI, model: str) -> None:
    for kw, param in (
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, model, **kw)
        assert info.value.param == param, (kw, info.value)


def test_langchain_bind_tools_and_structured_output(cluster: Cluster, model: str) -> None:
    from langchain_openai import ChatOpenAI

    class Forecast(pydantic.BaseModel):
        """The weather forecast of a city."""

        city: Literal["Paris", "Rome", "Oslo"]
        days: int = pydantic.Field(ge=1, le=7)

    llm = ChatOpenAI(base_url=f"{cluster.http_url}/v1", api_key="EMPTY", model=model, temperature=0, max_tokens=80)
    ai = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke(MESSAGES[0]["content"])
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER_PARAMS)
    assert (
        llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
        .invoke(MESSAGES[0]["content"])
        .tool_calls
    )
    got = llm.with_structured_output(Forecast, method="function_calling").invoke(MESSAGES[0]["content"])
    assert isinstance(got, Forecast)


def test_litellm_function_calling(cluster: Cluster, model: str) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    got = litellm.completion(
        model=f"openai/{model}",
        api_base=f"{cluster.http_url}/v1",
        api_key="EMPTY",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
        num_retries=0,
    )
    [call] = got.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and json.loads(call.function.arguments)
