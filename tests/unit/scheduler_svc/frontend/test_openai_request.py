"""OpenAI JSON -> pagedserve.v1 (``scheduler_svc.frontend.openai_request``) on plain data: what each body becomes,
the 400s that name the field and the mapping of the frontend's exceptions to HTTP statuses. The response and
stream-chunk shapes are in test_openai_response.py. No processes, no I/O."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend import openai_request as proto
from scheduler_svc.frontend import openai_response as answer
from scheduler_svc.frontend.refusals import (
    ContextLength,
    InvalidArgument,
    OverCapacity,
    QueueTimeout,
    StreamDetached,
    TooManyPending,
    Unavailable,
)
from scheduler_svc.state.store import DuplicateRequest

M = "tiny"


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": M, "prompt": "Hello", **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": M, "messages": [{"role": "user", "content": "Hi"}], **kw}


def test_a_completion_body_becomes_the_same_request_as_on_grpc() -> None:
    p = proto.parse(
        completion(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            seed=3,
            stop="END",
            stop_token_ids=[2, 5],
            ignore_eos=True,
            priority=-2,
            queue_timeout=1.5,
            user="ignored",
            unknown_extra={"x": 1},
        ),
        chat=False,
        request_id="r-1",
    )
    assert p.request == pb.GenerateRequest(
        request_id="r-1",
        prompt="Hello",
        priority=-2,
        queue_timeout=1.5,
        sampling=pb.SamplingParams(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            seed=3,
            stop=["END"],
            stop_token_ids=[2, 5],
            ignore_eos=True,
        ),
    )
    assert (p.model, p.chat, p.stream, p.include_usage, p.return_token_ids) == (M, False, False, False, False)


def test_unset_fields_stay_unset_so_the_grpc_defaults_apply() -> None:
    s = proto.parse(completion(), chat=False).request.sampling
    assert not any(s.HasField(f) for f in ("max_tokens", "temperature", "top_p", "top_k", "seed"))
    nulls = proto.parse(completion(max_tokens=None, temperature=None, stop=None, n=None, logprobs=None), chat=False)
    assert nulls.request.sampling == pb.SamplingParams()


@pytest.mark.parametrize(
    "prompt,field,value",
    [
        ("text", "prompt", "text"),
        (["text"], "prompt", "text"),
        ([5, 6, 7], "prompt_token_ids", [5, 6, 7]),
        ([[5, 6]], "prompt_token_ids", [5, 6]),
        ([5.0, 6], "prompt_token_ids", [5, 6]),
    ],
)
def test_prompt_forms(prompt: Any, field: str, value: Any) -> None:
    got = getattr(proto.parse(completion(prompt=prompt), chat=False).request, field)
    assert (list(got) if field == "prompt_token_ids" else got) == value


def test_chat_messages_content_parts_and_max_completion_tokens() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": None, "name": "bot"},
        ],
        max_tokens=9,
        max_completion_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
    )
    p = proto.parse(body, chat=True)
    assert [(m.role, m.content) for m in p.request.messages] == [
        ("system", "Be brief."),
        ("user", "one\ntwo"),
        ("assistant", ""),
    ]
    assert p.request.sampling.max_tokens == 4, "max_completion_tokens wins, as in vLLM"
    assert (p.stream, p.include_usage, p.return_token_ids) == (True, True, True)
    assert proto.parse(chat(max_tokens=9), chat=True).request.sampling.max_tokens == 9
    assert not proto.parse(chat(top_k=-1), chat=True).request.sampling.HasField("top_k"), "vLLM's -1: off"


def test_off_values_of_unsupported_fields_are_accepted() -> None:
    off = dict(
        n=1,
        presence_penalty=0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        min_p=0,
        logit_bias={},
        response_format={"type": "text"},
        best_of=1,
        echo=False,
        tools=[],
        top_logprobs=0,
        include_stop_str_in_output=False,
        bad_words=[],
        add_generation_prompt=True,
        continue_final_message=False,
        use_beam_search=False,
        truncate_prompt_tokens=None,
        request_id="",
        chat_template_kwargs={},
        skip_special_tokens=True,
        tool_choice="none",
        length_penalty=1,
        truncation_side="left",
        stream_interval=1,
    )
    proto.parse(completion(**off, add_special_tokens=True), chat=False)
    proto.parse(chat(logprobs=False, **off, add_special_tokens=False), chat=True)
    assert proto.parse(completion(n=3, best_of=3), chat=False).request.sampling.n == 3


def test_vllm_s_fields_become_the_request_s() -> None:
    p = proto.parse(
        chat(
            include_stop_str_in_output=True,
            allowed_token_ids=[5, 9],
            bad_words=["Paris", " big cat"],
            add_generation_prompt=False,
            continue_final_message=True,
            chat_template_kwargs={"enable_thinking": False, "depth": 2},
            truncate_prompt_tokens=-1,
            request_id="body-id",
        ),
        chat=True,
        request_id="body-id",
    )
    r = p.request
    assert r.sampling.include_stop_str_in_output and list(r.sampling.allowed_token_ids) == [5, 9]
    assert list(r.sampling.bad_words) == ["Paris", " big cat"]
    assert r.HasField("add_generation_prompt") and not r.add_generation_prompt and r.continue_final_message
    assert dict(r.chat_template_kwargs) == {"enable_thinking": False, "depth": 2}
    assert r.truncate_prompt_tokens == -1 and r.request_id == "body-id"
    assert proto.parse(completion(request_id="only-body"), chat=False).request.request_id == "only-body"
    with pytest.raises(proto.ApiError) as info:
        proto.parse(completion(request_id="a"), chat=False, request_id="b")
    assert info.value.status == 400 and info.value.param == "request_id"


BAD: list[tuple[str, dict[str, Any], bool, str]] = [
    ("no model", {"prompt": "x"}, False, "model"),
    ("model not a string", completion(model=5), False, "model"),
    ("max_tokens 0", completion(max_tokens=0), False, "max_tokens"),
    ("max_tokens negative", completion(max_tokens=-3), False, "max_tokens"),
    ("max_tokens a string", completion(max_tokens="8"), False, "max_tokens"),
    ("max_tokens a bool", completion(max_tokens=True), False, "max_tokens"),
    ("max_tokens over uint32", completion(max_tokens=1 << 40), False, "max_tokens"),
    ("max_completion_tokens 0", chat(max_completion_tokens=0), True, "max_completion_tokens"),
    ("temperature a string", completion(temperature="hot"), False, "temperature"),
    ("temperature NaN", completion(temperature=float("nan")), False, "temperature"),
    ("temperature over float32", completion(temperature=1e39), False, "temperature"),
    ("top_k -2", completion(top_k=-2), False, "top_k"),
    ("seed negative", completion(seed=-1), False, "seed"),
    ("stop a number", completion(stop=3), False, "stop"),
    ("stop item a number", completion(stop=["a", 3]), False, "stop[1]"),
    ("stop_token_ids negative", completion(stop_token_ids=[-1]), False, "stop_token_ids[0]"),
    ("ignore_eos a string", completion(ignore_eos="yes"), False, "ignore_eos"),
    ("priority a float", completion(priority=0.5), False, "priority"),
    ("n negative", completion(n=-1), False, "n"),
    ("n a string", completion(n="1"), False, "n"),
    ("logprobs negative", completion(logprobs=-1), False, "logprobs"),
    ("logprobs a flag on a completion", completion(logprobs=True), False, "logprobs"),
    ("logprobs a number on a chat", chat(logprobs=3), True, "logprobs"),
    ("top_logprobs without logprobs", chat(top_logprobs=3), True, "top_logprobs"),
    ("prompt_logprobs a string", completion(prompt_logprobs="2"), False, "prompt_logprobs"),
    ("presence_penalty a string", completion(presence_penalty="0.5"), False, "presence_penalty"),
    ("frequency_penalty NaN", chat(frequency_penalty=float("nan")), True, "frequency_penalty"),
    ("logit_bias a list", completion(logit_bias=[5, 10]), False, "logit_bias"),
    ("logit_bias key not an id", completion(logit_bias={"a": 10}), False, "logit_bias"),
    ("logit_bias value a string", completion(logit_bias={"5": "x"}), False, "logit_bias[5]"),
    ("min_tokens negative", completion(min_tokens=-1), False, "min_tokens"),
    ("min_p a string", completion(min_p="0.1"), False, "min_p"),
    ("response_format a string", chat(response_format="json"), True, "response_format"),
    ("response_format type", chat(response_format={"type": "xml"}), True, "response_format.type"),
    (
        "json_schema without schema",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a"}}),
        True,
        "response_format.json_schema.schema",
    ),
    (
        "json_schema without name",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        True,
        "response_format.json_schema.name",
    ),
    (
        "schema a number",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}),
        True,
        "response_format.json_schema.schema",
    ),
    ("guided_choice empty", completion(guided_choice=[]), False, "guided_choice"),
    ("guided_choice item", completion(guided_choice=["a", 3]), False, "guided_choice[1]"),
    ("guided_regex a number", completion(guided_regex=3), False, "guided_regex"),
    ("structured_outputs a list", completion(structured_outputs=[]), False, "structured_outputs"),
    (
        "structured_outputs json_object false",
        completion(structured_outputs={"json_object": False}),
        False,
        "structured_outputs.json_object",
    ),
    ("two constraints", chat(response_format={"type": "json_object"}, guided_regex="a+"), True, "guided_regex"),
    ("tools not a list", chat(tools={"type": "function"}), True, "tools"),
    ("tool without a name", chat(tools=[{"type": "function", "function": {}}]), True, "tools[0].function.name"),
    ("tool of another type", chat(tools=[{"type": "retrieval"}]), True, "tools[0].type"),
    (
        "tool parameters a list",
        chat(tools=[{"function": {"name": "f", "parameters": []}}]),
        True,
        "tools[0].function.parameters",
    ),
    ("tool_choice unknown", chat(tool_choice="any"), True, "tool_choice"),
    (
        "tool_choice without a name",
        chat(tool_choice={"type": "function", "function": {}}),
        True,
        "tool_choice.function.name",
    ),
    ("parallel_tool_calls a string", chat(parallel_tool_calls="no"), True, "parallel_tool_calls"),
    ("tools on completions", completion(tools=[{"type": "function", "function": {"name": "f"}}]), False, "tools"),
    (
        "a tool call without arguments text",
        chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}]),
        True,
        "messages[0].tool_calls[0].function.arguments",
    ),
    # vLLM's fields (issue #22): honoured ones with bad values, and those refused by name.
    (
        "include_stop_str_in_output a string",
        completion(include_stop_str_in_output="y"),
        False,
        "include_stop_str_in_output",
    ),
    ("allowed_token_ids empty", completion(allowed_token_ids=[]), False, "allowed_token_ids"),
    ("allowed_token_ids negative", completion(allowed_token_ids=[3, -1]), False, "allowed_token_ids[1]"),
    ("bad_words a string", completion(bad_words="Paris"), False, "bad_words"),
    ("bad_words item a number", completion(bad_words=["a", 3]), False, "bad_words[1]"),
    ("add_generation_prompt a string", chat(add_generation_prompt="no"), True, "add_generation_prompt"),
    ("continue_final_message a number", chat(continue_final_message=1), True, "continue_final_message"),
    ("chat_template_kwargs a list", chat(chat_template_kwargs=[1]), True, "chat_template_kwargs"),
    ("truncate_prompt_tokens a string", completion(truncate_prompt_tokens="8"), False, "truncate_prompt_tokens"),
    ("request_id not ASCII", completion(request_id="é"), False, "request_id"),
    ("request_id a number", completion(request_id=5), False, "request_id"),
    ("use_beam_search", completion(use_beam_search=True), False, "use_beam_search"),
    ("best_of over n", completion(best_of=2), False, "best_of"),
    ("best_of under n", completion(n=3, best_of=1), False, "best_of"),
    ("skip_special_tokens false", completion(skip_special_tokens=False), False, "skip_special_tokens"),
    ("add_special_tokens on a chat", chat(add_special_tokens=True), True, "add_special_tokens"),
    ("truncation_side right", completion(truncation_side="right"), False, "truncation_side"),
    ("length_penalty a bool", completion(length_penalty=True), False, "length_penalty"),
    ("several prompts", completion(prompt=["a", "b"]), False, "prompt"),
    ("empty prompt", completion(prompt=""), False, "prompt"),
    ("empty prompt list", completion(prompt=[]), False, "prompt"),
    ("prompt an object", completion(prompt={"text": "a"}), False, "prompt"),
    ("no prompt", {"model": M}, False, "prompt"),
    ("prompt with a lone surrogate", completion(prompt="a\ud800"), False, "prompt"),
    ("token id a string", completion(prompt=[1, "2"]), False, "prompt[1]"),
    ("no messages", {"model": M}, True, "messages"),
    ("messages not a list", chat(messages="hi"), True, "messages"),
    ("message not an object", chat(messages=["hi"]), True, "messages[0]"),
    ("role missing", chat(messages=[{"content": "hi"}]), True, "messages[0].role"),
    ("content a number", chat(messages=[{"role": "user", "content": 5}]), True, "messages[0].content"),
    (
        "image part",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        True,
        "messages[0].content[0]",
    ),
    ("stream a string", completion(stream="yes"), False, "stream"),
    ("stream_options without stream", completion(stream_options={"include_usage": True}), False, "stream_options"),
    (
        "include_usage a string",
        completion(stream=True, stream_options={"include_usage": "y"}),
        False,
        "stream_options.include_usage",
    ),
]


@pytest.mark.parametrize("body,is_chat,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_values_are_400_naming_the_field(body: dict[str, Any], is_chat: bool, param: str) -> None:
    with pytest.raises(proto.ApiError) as info:
        proto.parse(body, chat=is_chat)
    err = info.value
    assert err.status == 400 and err.param == param and err.message.startswith(param + ":"), err.message
    assert err.body() == {
        "error": {"message": err.message, "type": "invalid_request_error", "param": param, "code": None}
    }


def test_frontend_fields_are_renamed_to_openai_fields() -> None:
    def answer_of(exc: InvalidArgument) -> tuple[str, str | None]:
        err = proto.error_for(exc)
        assert err is not None
        return err.message, err.param

    assert answer_of(InvalidArgument("sampling.max_tokens", "must be positive")) == (
        "max_tokens: must be positive",
        "max_tokens",
    )
    assert answer_of(InvalidArgument("sampling.stop[1]", "9 characters")) == ("stop[1]: 9 characters", "stop[1]")
    assert answer_of(InvalidArgument("prompt_token_ids", "ids must be below")) == (
        "prompt: ids must be below",
        "prompt",
    )
    assert answer_of(InvalidArgument("request_id", "printable ASCII only")) == (
        "X-Request-Id: printable ASCII only",
        "X-Request-Id",
    )
    assert answer_of(InvalidArgument(None, "exactly one of prompt, messages must be set (got: none)"))[1] is None
    assert proto.openai_field("messages[0].role") == "messages[0].role"


def test_exceptions_map_to_statuses() -> None:
    def status(exc: BaseException) -> tuple[int, str, str | None, str | None, dict[str, str]]:
        err = proto.error_for(exc)
        assert err is not None
        return err.status, err.type, err.param, err.code, err.headers

    assert status(InvalidArgument("sampling.top_p", "must be in (0, 1]")) == (
        400,
        "invalid_request_error",
        "top_p",
        None,
        {},
    )
    assert status(ContextLength("prompt", 512, 600, 16))[:4] == (
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    )
    over = proto.error_for(OverCapacity(40, 24))
    assert over is not None and (over.status, over.code, over.param) == (400, "context_length_exceeded", None)
    assert over.message == "prompt + max_tokens need 40 KV blocks; the largest executor pool has 24"
    assert (
        str(OverCapacity(40, 24)) == "prompt + sampling.max_tokens need 40 KV blocks; the largest executor pool has 24"
    )
    assert status(TooManyPending(2, 2, 3)) == (429, "requests", None, "rate_limit_exceeded", {"Retry-After": "3"})
    assert status(QueueTimeout("r"))[:4] == (504, "timeout", "queue_timeout", "queue_timeout")
    assert status(QueueTimeout("r"))[4] == {"x-should-retry": "false"}
    assert status(DuplicateRequest("r"))[0::3] == (409, "duplicate_request_id")
    assert status(Unavailable("draining"))[:2] == (503, "server_error")
    assert status(redis.ConnectionError("down"))[0] == 503
    detached = proto.error_for(StreamDetached("r-9", 12))
    assert detached is not None and detached.status == 503
    assert detached.body()["error"] | {"message": ""} == {
        "message": "",
        "type": "server_error",
        "param": None,
        "code": "stream_detached",
        "request_id": "r-9",
        "offset": 12,
    }
    assert proto.error_for(KeyError("x")) is None, "a bug is not mapped: it is a 500"


def test_chat_without_a_limit_runs_to_the_end_of_the_context_a_pool_holds() -> None:
    from scheduler_svc.frontend.validate import Limits

    # Two executors: a 512-token context on a pool of 24 blocks of 16 (384 tokens), and a
    # 256-token context on a pool of 64 blocks: the first lets a 100-token prompt go furthest.
    limits = Limits(512, 1000, 16, ((24, 512), (64, 256)))
    assert proto.context_room(limits, 100) == 384 - 100
    assert proto.context_room(Limits(512, 1000, 16, ((64, 512),)), 100) == 512 - 100
    assert proto.context_room(limits, 400) == 1, "never less than one token"


def test_sampling_options_map_to_the_grpc_fields() -> None:
    s = proto.parse(
        completion(
            presence_penalty=0.5,
            frequency_penalty=-1,
            repetition_penalty=1.2,
            min_p=0.1,
            min_tokens=3,
            logit_bias={"5": 10, "7": -100},
            logprobs=2,
            prompt_logprobs=1,
        ),
        chat=False,
    ).request.sampling
    assert s == pb.SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=3,
        logit_bias={5: 10, 7: -100},
        logprobs=2,
        prompt_logprobs=1,
    )
    assert proto.parse(chat(logprobs=True, top_logprobs=4), chat=True).request.sampling.logprobs == 4
    assert proto.parse(chat(logprobs=True), chat=True).request.sampling == pb.SamplingParams(logprobs=0)
    assert not proto.parse(chat(logprobs=False, top_logprobs=0), chat=True).request.sampling.HasField("logprobs")


def test_structured_output_fields() -> None:
    """response_format (OpenAI), structured_outputs (vLLM) and guided_* (older vLLM) map to
    sampling.structured_output; "text" is no constraint."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = lambda body, is_chat=True: proto.parse(body, chat=is_chat).request.sampling.structured_output  # noqa: E731
    got = so(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert json.loads(got.json_schema) == schema
    assert so(chat(response_format={"type": "json_object"})).json_object
    assert not proto.parse(chat(response_format={"type": "text"}), chat=True).request.sampling.HasField(
        "structured_output"
    )
    assert json.loads(so(completion(guided_json=schema), False).json_schema) == schema
    assert so(completion(guided_json='{"type": "string"}'), False).json_schema == '{"type": "string"}'
    assert so(completion(guided_regex="[0-9]+"), False).regex == "[0-9]+"
    assert list(so(completion(guided_choice=["yes", "no"]), False).choice.choices) == ["yes", "no"]
    assert so(completion(guided_grammar='root ::= "a"'), False).grammar == 'root ::= "a"'
    assert so(chat(structured_outputs={"regex": "a+", "disable_any_whitespace": True})).regex == "a+"
    assert so(chat(structured_outputs={"json_object": True})).json_object
    assert proto.parse(chat(guided_regex="a+"), chat=True).structured_param == "guided_regex"


def test_a_refused_spec_is_named_as_the_body_named_it() -> None:
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    parsed = proto.parse(body, chat=True)
    err = proto.structured_error(
        InvalidArgument("sampling.structured_output.json_schema", "does not compile: bad"), parsed
    )
    assert err is not None and err.status == 400 and err.param == "response_format.json_schema.schema"
    assert err.message == "response_format.json_schema.schema: does not compile: bad"
    assert proto.structured_error(InvalidArgument("sampling.top_p", "bad"), parsed) is None


def test_cache_salt_passes_through_and_usage_reports_cached_tokens() -> None:
    from scheduler_svc.core.prefix import MAX_SALT
    from scheduler_svc.frontend import validate

    p = proto.parse(chat(cache_salt="tenant-7"), chat=True)
    assert p.request.cache_salt == "tenant-7" and p.request.HasField("cache_salt")
    assert not proto.parse(chat(), chat=True).request.HasField("cache_salt")
    with pytest.raises(proto.ApiError, match="cache_salt"):
        proto.parse(chat(cache_salt=3), chat=True)
    limits = validate.Limits(max_model_len=64, vocab_size=100, block_size=16, pools=((8, 64),))
    with pytest.raises(InvalidArgument, match="cache_salt"):
        validate.check(pb.GenerateRequest(prompt="x", cache_salt="s" * (MAX_SALT + 1)), limits)
    assert validate.check(pb.GenerateRequest(prompt="x", cache_salt="s"), limits).cache_salt == "s"
    assert answer.usage(40, 3, 32) == {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
