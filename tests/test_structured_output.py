"""Structured output on real deployments (real Redis, gRPC, SmolLM2 and tiny Llama).

JSON-schema requests always yield text that parses and validates against the schema
(nested objects, enums, arrays; greedy and seeded) and end with finish_reason "stop"; a
regex request matches its regex, a choice request returns one of the choices; a spec that
does not compile, or is over --max-grammar-bytes, is INVALID_ARGUMENT naming the field at
submission and nothing else breaks; structured requests preempted midway (swap and
recompute, a small pool) or led by a new loop after a SIGKILL produce exactly the tokens they
produce undisturbed; the openai
client's ``response_format`` json_schema over HTTP returns valid JSON.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pydantic
import pytest
import redis

from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import free_port
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests import helpers
from tests.conftest import make_cluster
from tests.helpers import Result, collect, run_all, wait_all_free
from tests.test_failover import run_in_background, wait_progress

MAX_GRAMMAR_BYTES = 4096
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "author": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "born": {"type": "integer", "minimum": 1000, "maximum": 2025},
            },
            "required": ["name", "born"],
            "additionalProperties": False,
        },
        "genre": {"enum": ["fiction", "history", "science"]},
    },
    "required": ["title", "author", "genre"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "sunny", "cold"]}, "minItems": 1, "maxItems": 3},
        "location": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "tags", "location"],
    "additionalProperties": False,
}
SCHEMAS = [("a person", PERSON), ("a book", BOOK), ("a city", CITY)]


class Author(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    born: int = pydantic.Field(ge=1000, le=2025)


class Book(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=30)
    author: Author
    genre: str = pydantic.Field(pattern="^(fiction|history|science)$")


SAMPLING = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.8, "top_p": 0.9, "seed": 2}]
REGEX = r"[A-Z][a-z]{2,9} is [0-9]{1,2} years old\."
CHOICES = ["yes", "no", "it depends"]


def chat(text: str, so: pb.StructuredOutput, max_tokens: int = 200, **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=text)],
        sampling=pb.SamplingParams(max_tokens=max_tokens, structured_output=so, **sampling),
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def smol(smol_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with make_cluster(
        smol_dir,
        redis_url,
        "structured",
        tmp_path_factory.mktemp("logs"),
        kv_cache_memory=64 << 20,
        scheduler_args=["--max-grammar-bytes", str(MAX_GRAMMAR_BYTES)],
        http_port=free_port(),
    ) as cluster:
        yield cluster


def test_json_schema_output_always_validates(smol: Cluster) -> None:
    reqs = [
        chat(f"Describe {what} as JSON.", pb.StructuredOutput(json_schema=json.dumps(schema)), **s)
        for what, schema in SCHEMAS
        for s in SAMPLING
    ]
    results = run_all(smol.address, reqs)
    for (what, schema), group in zip(SCHEMAS, [results[i : i + len(SAMPLING)] for i in range(0, len(results), 3)]):
        for s, res in zip(SAMPLING, group):
            assert res.finish_reason == "stop", (what, s, res.text)
            jsonschema.validate(json.loads(res.text), schema)
    again = run_all(smol.address, reqs[1:2])[0]
    assert again.token_ids == results[1].token_ids, "seeded structured sampling is reproducible"


def test_regex_choice_grammar_and_json_object(smol: Cluster) -> None:
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    reqs = [
        chat("How old is Tom? Answer in one sentence.", pb.StructuredOutput(regex=REGEX), temperature=0.0),
        chat("How old is Tom? Answer in one sentence.", pb.StructuredOutput(regex=REGEX), temperature=1.0, seed=5),
        chat("Is the sky blue?", pb.StructuredOutput(choice=pb.Choices(choices=CHOICES)), temperature=0.0),
        chat("Is the sky blue?", pb.StructuredOutput(choice=pb.Choices(choices=CHOICES)), temperature=1.0, seed=9),
        chat("Is the sky blue?", pb.StructuredOutput(grammar=grammar), temperature=0.0),
        chat("Describe a dog as JSON.", pb.StructuredOutput(json_object=True), max_tokens=120, temperature=0.0),
    ]
    regex1, regex2, choice1, choice2, ebnf, obj = run_all(smol.address, reqs)
    for res in (regex1, regex2):
        assert res.finish_reason == "stop" and re.fullmatch(REGEX, res.text), res.text
    for res in (choice1, choice2):
        assert res.finish_reason == "stop" and res.text in CHOICES, res.text
    assert ebnf.finish_reason == "stop" and ebnf.text in ("The answer is yes.", "The answer is no."), ebnf.text
    if obj.finish_reason == "stop":  # any object: it may be longer than max_tokens
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


BAD = [
    (pb.StructuredOutput(json_schema='{"type": "objectx"}'), "sampling.structured_output.json_schema"),
    (pb.StructuredOutput(json_schema='{"type": '), "sampling.structured_output.json_schema"),
    (pb.StructuredOutput(regex="a(b"), "sampling.structured_output.regex"),
    (pb.StructuredOutput(grammar="root ::= undefined_rule"), "sampling.structured_output.grammar"),
    (pb.StructuredOutput(regex="a" * (MAX_GRAMMAR_BYTES + 1)), "sampling.structured_output.regex"),
    (pb.StructuredOutput(choice=pb.Choices()), "sampling.structured_output.choice"),
]


@pytest.mark.parametrize("so,field", BAD, ids=["schema", "schema json", "regex", "grammar", "too big", "no choice"])
def test_a_spec_that_cannot_compile_is_invalid_argument(smol: Cluster, so: pb.StructuredOutput, field: str) -> None:
    async def go() -> tuple[grpc.aio.AioRpcError, Result]:
        async with grpc.aio.insecure_channel(smol.address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, chat("Hi", so, max_tokens=4))
            return info.value, await collect(
                stub, chat("Hi", pb.StructuredOutput(regex="[a-z]+"), max_tokens=4, temperature=0.0)
            )

    err, after = asyncio.run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and (err.details() or "").startswith(field + ":"), (
        err.details()
    )
    assert after.finish_reason in ("stop", "length") and re.fullmatch("[a-z]*", after.text), "the server goes on"


def test_openai_client_response_format_json_schema(smol: Cluster, smol_dir: Path) -> None:
    with openai.OpenAI(base_url=smol.http_url + "/v1", api_key="EMPTY", max_retries=0, timeout=300) as client:
        model = client.models.list().data[0].id
        got = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a book as JSON."}],
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK}},
        )
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].message.content or ""), BOOK)
        parsed = client.chat.completions.parse(  # the SDK's own schema from a pydantic model ($defs, strict)
            model=model,
            messages=[{"role": "user", "content": "Describe a book as JSON."}],
            max_tokens=200,
            temperature=0,
            response_format=Book,
        )
        book = parsed.choices[0].message.parsed
        assert isinstance(book, Book) and 1000 <= book.author.born <= 2025
        text = client.completions.create(
            model=model,
            prompt="Is water wet? Answer:",
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"choice": CHOICES}},
        )
        assert text.choices[0].text in CHOICES
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
            )
        err = info.value.body
        assert isinstance(err, dict) and err.get("param") == "response_format.json_schema.schema", err


# -- preemption (tiny Llama: random weights, so the grammar does all the work) ------------------

rng = random.Random(12)
PROMPTS = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 60))] for _ in range(8)]
SPECS = [
    pb.StructuredOutput(json_schema=json.dumps(PERSON)),
    pb.StructuredOutput(json_schema=json.dumps(BOOK)),
    pb.StructuredOutput(regex=REGEX),
    pb.StructuredOutput(choice=pb.Choices(choices=CHOICES)),
]


def structured_reqs() -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(
            prompt_token_ids=p,
            sampling=pb.SamplingParams(
                max_tokens=120,
                structured_output=SPECS[i % len(SPECS)],
                **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}),
            ),
        )  # type: ignore[arg-type]
        for i, p in enumerate(PROMPTS)
    ]


def check(results: list[Result]) -> None:
    for i, res in enumerate(results):
        spec = SPECS[i % len(SPECS)]
        assert res.finish_reason == "stop", (i, res.text)
        if spec.HasField("json_schema"):
            jsonschema.validate(json.loads(res.text), json.loads(spec.json_schema))
        elif spec.HasField("regex"):
            assert re.fullmatch(REGEX, res.text), res.text
        else:
            assert res.text in CHOICES


@pytest.fixture(scope="module")
def unpreempted(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> list[Result]:
    with make_cluster(tiny_llama, redis_url, "structured-ref", tmp_path_factory.mktemp("logs"), blocks=400) as cluster:
        results = run_all(cluster.address, structured_reqs())
    check(results)
    return results


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_structured_requests_survive_preemption(
    mode: str, tiny_llama: Path, redis_url: str, tmp_path: Path, unpreempted: list[Result]
) -> None:
    ns = f"structured-{mode}"
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=12,
        swap_blocks=64 if mode == "swap" else None,
        scheduler_args=["--preemption-mode", mode, "--max-num-batched-tokens", "48"],
    ) as cluster:
        results = run_all(cluster.address, structured_reqs())
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        free, totals = wait_all_free(client, ns)
        seen = helpers.counters(client, ns)
    assert seen[f"preemptions_{mode}"] > 0
    assert free == totals
    for i, (res, ref) in enumerate(zip(results, unpreempted)):
        assert res.token_ids == ref.token_ids, f"request {i} diverged under {mode} preemption"
    check(results)


def test_structured_requests_survive_a_new_leader(
    tiny_llama: Path, redis_url: str, tmp_path: Path, unpreempted: list[Result]
) -> None:
    """The loop is SIGKILLed mid-generation: the new leader resets the executor's tables (and its
    matchers) and resends full tables with the tokens before them; the matchers are rebuilt from
    those and every output is the one an undisturbed run gives."""
    ns = "structured-failover"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama, redis_url, ns, tmp_path, blocks=400, scheduler_args=["--lease-ms", "1500"]
    ) as cluster:
        worker, results = run_in_background(cluster.address, structured_reqs())
        wait_progress(client, ns, 40)
        epoch_key, epoch = helpers.kill_loop(client, ns, cluster.scheduler.proc.pid)
        worker.join(300)
        assert int(client.get(epoch_key)) > epoch, "a new loop took the lease"
        free, totals = wait_all_free(client, ns)
    assert free == totals
    assert [r.token_ids for r in results] == [r.token_ids for r in unpreempted]
    check(results)
