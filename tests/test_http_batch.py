"""Batched prompts and ``echo`` on ``/v1/completions``, on one real deployment of tiny Llama (real
Redis, the scheduler's uvicorn) through the official ``openai`` client, LangChain's ``OpenAI``
and lm-evaluation-harness's ``local-completions`` model.

Each prompt of a batch answers as it does alone on the gRPC API (greedy: token for token;
seeded: choice prompt × n + i samples with seed + i); usage adds up over the prompts. Echo
puts the prompt, and with ``logprobs`` the prompt tokens' logprobs, in front: those equal
transformers' ``log_softmax`` of the model's logits (the first prompt token's is null), and
``max_tokens: 0`` answers the prompt alone (lm-eval's loglikelihood path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import free_port
from pagedserve.v1 import generation_pb2 as pb
from tests.conftest import make_cluster
from tests.helpers import Result, run_all

SENTENCES = [
    "The capital of France is Paris, and the capital of Italy is",
    "A key-value cache keeps the attention keys and values of every token",
    "Once upon a time there was a small robot who",
]
ATOL = 1e-4
HANG_GUARD_S = 300  # only against a hang: nothing here is timed


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with make_cluster(
        tiny_llama,
        redis_url,
        "http-batch",
        tmp_path_factory.mktemp("logs"),
        blocks=64,
        http_port=free_port(),
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> str:
    return tiny_llama.name


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def request(prompt: str, max_tokens: int, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


@pytest.fixture(scope="module")
def greedy(cluster: Cluster) -> list[Result]:
    """Each sentence, 10 greedy tokens, as a request of its own on the gRPC API."""
    return run_all(cluster.address, [request(s, 10, temperature=0) for s in SENTENCES])


def log_softmax(hf: AutoModelForCausalLM, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of each token of ``ids`` from the second on."""
    with torch.inference_mode():
        rows = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return rows[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


# --- batched prompts ----------------------------------------------------------------


def test_a_batch_answers_each_prompt_as_the_grpc_api_does_alone(
    client: openai.OpenAI, model: str, tok: Any, greedy: list[Result]
) -> None:
    want = greedy
    got = client.completions.create(
        model=model, prompt=SENTENCES, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in got.choices] == [w.token_ids for w in want]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.finish_reason for c in got.choices] == [w.finish_reason for w in want]
    assert got.usage.prompt_tokens == sum(w.prompt_tokens for w in want)
    assert got.usage.completion_tokens == sum(w.completion_tokens for w in want)

    ids = [tok(s).input_ids for s in SENTENCES]
    by_ids = client.completions.create(
        model=model, prompt=ids, max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [c.model_extra["token_ids"] for c in by_ids.choices] == [w.token_ids for w in want]
    assert [c.model_extra["prompt_token_ids"] for c in by_ids.choices] == ids

    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    chunks = list(
        client.completions.create(
            model=model,
            prompt=SENTENCES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert texts == {i: w.text for i, w in enumerate(want)}
    assert finished == {i: w.finish_reason for i, w in enumerate(want)}
    assert chunks[-1].usage.total_tokens == got.usage.total_tokens


def test_n_with_a_batch_numbers_choices_prompt_by_prompt(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    """vLLM's numbering: choice prompt × n + i, which samples with seed + i as a request alone does."""
    prompts = SENTENCES[:2]
    got = client.completions.create(
        model=model,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0.9,
        seed=11,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    want = run_all(
        cluster.address, [request(p, 6, temperature=0.9, seed=11 + i, ignore_eos=True) for p in prompts for i in (0, 1)]
    )
    assert [c.model_extra["token_ids"] for c in got.choices] == [w.token_ids for w in want]
    prompt_tokens = want[0].prompt_tokens + want[2].prompt_tokens
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_tokens, 4 * 6)


def test_a_bad_prompt_of_a_batch_is_a_400_naming_it(client: openai.OpenAI, model: str) -> None:
    for prompt, param in [(["fine", ""], "prompt[1]"), ([[1, 2], [3, -1]], "prompt[1][1]")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[[1, 2], [3, 10**9]], max_tokens=2)
    assert info.value.body["param"] == "prompt[1]", info.value.body  # the vocabulary check, after parsing


# --- echo ---------------------------------------------------------------------------


def test_echo_with_max_tokens_0_gives_the_prompt_logprobs_of_transformers(
    client: openai.OpenAI, model: str, tok: Any, hf: AutoModelForCausalLM
) -> None:
    got = client.completions.create(model=model, prompt=SENTENCES, echo=True, logprobs=1, max_tokens=0)
    assert got.usage.completion_tokens == 0
    for sentence, choice in zip(SENTENCES, got.choices):
        ids = tok(sentence).input_ids
        assert choice.text == sentence and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(log_softmax(hf, ids).tolist(), abs=ATOL)
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]


def test_echo_puts_the_prompt_in_front_streamed_or_not(client: openai.OpenAI, model: str, greedy: list[Result]) -> None:
    want = greedy[0]
    got = client.completions.create(model=model, prompt=SENTENCES[0], echo=True, max_tokens=10, temperature=0)
    assert got.choices[0].text == SENTENCES[0] + want.text
    assert got.usage.completion_tokens == want.completion_tokens
    streamed = client.completions.create(
        model=model, prompt=SENTENCES[0], echo=True, logprobs=0, max_tokens=10, temperature=0, stream=True
    )
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert chunks[0].text.startswith(SENTENCES[0]) and "".join(c.text for c in chunks) == got.choices[0].text
    lps = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert lps[0] is None and len(lps) == want.prompt_tokens + want.completion_tokens


# --- clients ------------------------------------------------------------------------


def test_langchain_openai_batch(cluster: Cluster, model: str, greedy: list[Result]) -> None:
    from langchain_openai import OpenAI

    assert cluster.http_url is not None
    llm = OpenAI(base_url=cluster.http_url + "/v1", api_key="EMPTY", model=model, temperature=0, max_tokens=10)
    assert llm.batch(SENTENCES) == [w.text for w in greedy]


def test_lm_eval_local_completions_loglikelihood(
    cluster: Cluster, model: str, tiny_llama: Path, hf: AutoModelForCausalLM
) -> None:
    """lm-eval sends the pairs as one batch of token ids with echo, logprobs 1 and max_tokens 1,
    and sums the continuation's logprobs."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    assert cluster.http_url is not None
    lm = LocalCompletionsAPI(
        base_url=cluster.http_url + "/v1/completions",
        model=model,
        tokenizer=str(tiny_llama),
        tokenizer_backend="huggingface",
        batch_size=3,
        max_retries=1,
    )
    pairs = [(s.rsplit(" ", 1)[0], " " + s.rsplit(" ", 1)[1]) for s in SENTENCES]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True)
    for (ctx, cont), (logprob, _) in zip(pairs, got):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        want = log_softmax(hf, ctx_ids + cont_ids)[len(ctx_ids) - 1 :].sum().item()
        assert logprob == pytest.approx(want, abs=ATOL * len(cont_ids))


# --- /v1/responses (the chat path underneath: the same tokens as a chat completion) --------------------------------

ASK = "Name the capital of France."
RULES = "Answer in one word."


class Verdict(BaseModel):
    """A structured answer: its grammar ends the random model's output, so the Response completes."""

    ok: bool


def chat_text(client: openai.OpenAI, model: str, messages: list[dict[str, str]], **kw: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)  # type: ignore[arg-type]


def test_responses_answer_as_the_chat_completion_of_the_same_messages(client: openai.OpenAI, model: str) -> None:
    chat = chat_text(
        client, model, [{"role": "system", "content": RULES}, {"role": "user", "content": ASK}], max_tokens=12
    )
    got = client.responses.create(model=model, input=ASK, instructions=RULES, max_output_tokens=12, temperature=0)
    assert got.output_text == chat.choices[0].message.content and got.output_text
    assert got.id.startswith("resp_") and got.object == "response" and got.model == chat.model
    assert chat.choices[0].finish_reason == "length"  # random weights: the model never stops by itself
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert got.instructions == RULES and got.max_output_tokens == 12

    events = list(
        client.responses.create(
            model=model, input=ASK, instructions=RULES, max_output_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == got.output_text and events[-1].response.usage == got.usage
    assert client.responses.retrieve(events[-1].response.id) == events[-1].response  # kept as it streamed


def test_responses_structured_output_completes_streamed_or_not(client: openai.OpenAI, model: str) -> None:
    """``text.format`` is chat's ``response_format``; the grammar ends the answer: ``response.completed``."""
    schema = Verdict.model_json_schema() | {"additionalProperties": False}
    chat = chat_text(
        client,
        model,
        [{"role": "user", "content": ASK}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema, "strict": True}},
    )
    assert chat.choices[0].finish_reason == "stop"
    parsed = client.responses.parse(model=model, input=ASK, text_format=Verdict, max_output_tokens=60, temperature=0)
    assert parsed.status == "completed" and parsed.output_text == chat.choices[0].message.content
    assert parsed.output_parsed == Verdict.model_validate_json(parsed.output_text)
    with client.responses.stream(
        model=model, input=ASK, text_format=Verdict, max_output_tokens=60, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed" and final.output_text == parsed.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == parsed.output_text


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input=ASK, instructions=RULES, max_output_tokens=6, temperature=0)
    then = client.responses.create(
        model=model, input="And of Italy?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    history = [
        {"role": "user", "content": ASK},  # the instructions are not carried over, as OpenAI
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ]
    chat = chat_text(client, model, history, max_tokens=6)
    assert then.output_text == chat.choices[0].message.content and then.previous_response_id == first.id
    assert then.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    unstored = client.responses.create(model=model, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="x", previous_response_id=unstored.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),  # the chat path's refusal, in Responses' words
        ({"temperature": "hot"}, "temperature"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
    ],
)
def test_responses_refuse_what_they_do_not_honour_naming_it(
    cluster: Cluster, model: str, extra: dict[str, Any], param: str
) -> None:
    assert cluster.http_url is not None
    got = httpx.post(cluster.http_url + "/v1/responses", json={"model": model, "input": "x"} | extra, timeout=60)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param and got.json()["error"]["type"] == "invalid_request_error"


def test_openai_agents_sdk_runs_an_agent(cluster: Cluster, model: str, client: openai.OpenAI) -> None:
    """``Runner.run`` and ``Runner.run_streamed`` on ``OpenAIResponsesModel``: the Agents SDK's default API."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    assert cluster.http_url is not None
    set_tracing_disabled(True)
    settings = ModelSettings(temperature=0, max_tokens=60)
    want = client.responses.parse(
        model=model, input=ASK, instructions=RULES, text_format=Verdict, max_output_tokens=60, temperature=0
    ).output_parsed

    async def run() -> tuple[Any, Any]:
        remote = openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
        async with remote:
            agent = Agent(
                name="judge",
                instructions=RULES,
                model=OpenAIResponsesModel(model=model, openai_client=remote),
                model_settings=settings,
                output_type=Verdict,
            )
            done = await Runner.run(agent, ASK)
            streamed = Runner.run_streamed(agent, ASK)
            async for _ in streamed.stream_events():
                pass
            return done.final_output, streamed.final_output

    assert asyncio.run(run()) == (want, want)


def test_langchain_chat_openai_on_the_responses_api(cluster: Cluster, model: str, client: openai.OpenAI) -> None:
    from langchain_openai import ChatOpenAI

    assert cluster.http_url is not None
    llm = ChatOpenAI(
        base_url=cluster.http_url + "/v1",
        api_key="EMPTY",  # type: ignore[arg-type]
        model=model,
        temperature=0,
        max_tokens=8,  # type: ignore[call-arg]
        use_responses_api=True,
    )
    want = chat_text(client, model, [{"role": "user", "content": ASK}], max_tokens=8).choices[0].message.content
    got = llm.invoke(ASK)
    assert got.text == want and got.response_metadata["id"].startswith("resp_")


# --- /v1/responses with function tools: run once the chat path takes tools (the tools branch) --------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


def test_a_tool_round_trip_on_the_responses_api(client: openai.OpenAI, model: str) -> None:
    """A named tool choice (the grammar makes the random model call it) answers a function_call item, as chat's
    tool call; the call's result goes back by ``previous_response_id`` or as input items, as chat's tool message."""
    named: Any = {"type": "function", "name": "get_weather"}
    ask: Any = {"tools": [WEATHER], "max_output_tokens": 60, "temperature": 0}
    first = client.responses.create(model=model, input=ASK, tool_choice=named, **ask)
    chat = chat_text(
        client,
        model,
        [{"role": "user", "content": ASK}],
        tools=[CHAT_WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
    )
    want = chat.choices[0].message.tool_calls
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(w.function.name, w.function.arguments) for w in want]
    assert first.status == "completed" and calls[0].call_id

    events = list(client.responses.create(model=model, input=ASK, tool_choice=named, stream=True, **ask))
    assert events[-1].type == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    assert [o.arguments for o in events[-1].response.output if o.type == "function_call"] == [calls[0].arguments]

    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
    call_back = {"tool_choice": "none", "max_output_tokens": 8, "temperature": 0, "tools": [WEATHER]}
    by_id = client.responses.create(model=model, previous_response_id=first.id, input=[result], **call_back)
    items = [{"role": "user", "content": ASK}, *[c.model_dump(exclude_none=True) for c in calls], result]
    by_items = client.responses.create(model=model, input=items, **call_back)  # type: ignore[arg-type]
    history: Any = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
    ]
    then = chat_text(client, model, history, tools=[CHAT_WEATHER], tool_choice="none", max_tokens=8)
    assert by_id.output_text == by_items.output_text == then.choices[0].message.content


def test_openai_agents_sdk_calls_a_tool(cluster: Cluster, model: str) -> None:
    """The Agents SDK's tool loop: the model (made to, by a named tool choice) calls the tool, the SDK runs it."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    assert cluster.http_url is not None
    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    async def run() -> Any:
        remote = openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
        async with remote:
            agent = Agent(
                name="weather",
                model=OpenAIResponsesModel(model=model, openai_client=remote),
                model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="get_weather"),
                tools=[get_weather],
                tool_use_behavior="stop_on_first_tool",
            )
            return (await Runner.run(agent, ASK)).final_output

    assert asyncio.run(run()) == f"sunny in {ran[0]}" and len(ran) == 1
