"""The OpenAI-compatible HTTP door (``--http-port``) on real deployments: tiny Llama, real
Redis, the scheduler's uvicorn, and the official ``openai`` client (sync and async) or raw
``httpx`` where a test needs the bytes.

Greedy output through HTTP is token-identical to the gRPC API's (which
tests/test_e2e_oracle.py ties to transformers); bad input is a 400 naming the field and
never a 500; an unknown model is a 404; over ``--max-pending-requests`` a 429 with
``Retry-After`` while accepted requests complete; a client that hangs up, mid-stream or
while queued, aborts its request and frees its blocks; a draining replica ends its streams
with an error event saying where to resume. With keys and TLS: 401 without a key or with a
wrong one, either of two keys served, ``/health`` open, HTTPS only, certificates reloaded
without a restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import redis
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from pagedserve.dev import devcerts
from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import free_port, wait_until
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.security import ReloadingSSLContext
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests import prometheus
from tests.conftest import make_cluster
from tests.helpers import Result, block_bytes, greedy, run_all, until, wait_all_free
from tests.test_prometheus import VLLM_NAMING

NS, SECURE_NS = "http", "http-secure"
MAX_PENDING = 2
PROMPT = list(range(300, 340))
KEYS = ("http-key-one-aaaaaaaaaaaaaaaaaaaaaa", "http-key-two-bbbbbbbbbbbbbbbbbbbbbb")
HANG_GUARD_S = 120  # only against a hang: nothing here is timed


# A template variable of our own, so that chat_template_kwargs can be seen reaching the template.
HOUSE_STYLE = "{% if house_style is defined %}{{ '<|im_start|>system\\n' + house_style + '<|im_end|>\\n' }}{% endif %}"


@pytest.fixture(scope="module")
def templated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama (same name) whose chat template first renders the ``house_style`` variable when given."""
    dst = tmp_path_factory.mktemp("templated") / tiny_llama.name
    shutil.copytree(tiny_llama, dst)
    template = dst / "chat_template.jinja"
    template.write_text(HOUSE_STYLE + template.read_text())
    return dst


@pytest.fixture(scope="module")
def cluster(templated: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One sequence at a time (``--max-num-seqs 1``), so that a long request ahead keeps the
    others queued for the admission tests; every other test sends one request at a time."""
    args = ["--max-num-seqs", "1", "--max-pending-requests", str(MAX_PENDING)]
    with make_cluster(
        templated,
        redis_url,
        NS,
        tmp_path_factory.mktemp("logs"),
        blocks=40,
        scheduler_args=args,
        http_port=free_port(),
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(templated: Path) -> str:
    return str(templated.absolute())  # the model directory as the executor loaded it: /v1/models' id


@pytest.fixture()
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def grpc_greedy(cluster: Cluster, req: pb.GenerateRequest) -> Result:
    return run_all(cluster.address, [req])[0]


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """The parsed ``data:`` payloads of an event stream (``[DONE]`` as the string)."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


# --- answers ----------------------------------------------------------------------


def test_completions_match_the_grpc_api_token_for_token(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    want = grpc_greedy(cluster, greedy(PROMPT, 24, ignore_eos=True))
    got = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == want.token_ids and choice.text == want.text
    assert choice.finish_reason == "length" and got.object == "text_completion" and got.model == model
    assert got.usage is not None and (got.usage.prompt_tokens, got.usage.completion_tokens) == (40, 24)
    assert got.usage.total_tokens == 64 and got.id.startswith("cmpl-")

    text = pb.GenerateRequest(prompt="Hello there, how are", sampling=pb.SamplingParams(max_tokens=16, temperature=0))
    want = grpc_greedy(cluster, text)
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hello there, how are",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == want.token_ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert len(chunks) > 2 and chunks[-2].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens


def test_cache_salt_and_cached_tokens(client: openai.OpenAI, model: str) -> None:
    """A repeated prompt reuses its cached blocks (usage says how many tokens); another salt shares none."""
    prompt = list(range(900, 940))  # 2 full blocks + 8 tokens: 32 tokens can come from the cache

    def cached(**extra: Any) -> int:
        got = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        assert got.usage is not None
        return got.usage.prompt_tokens_details.cached_tokens

    assert [cached(), cached(), cached(cache_salt="tenant"), cached(cache_salt="tenant")] == [0, 32, 0, 32]


def test_chat_completions_match_the_grpc_api(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    want = grpc_greedy(
        cluster,
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in messages],
            sampling=pb.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        ),
    )
    got = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers={"X-Request-Id": "chat-by-id"},
    )
    assert got.id == "chatcmpl-chat-by-id" and got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.choices[0].model_extra["token_ids"] == want.token_ids
    assert got.usage is not None and got.usage.prompt_tokens == want.prompt_tokens

    async def stream() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="EMPTY", max_retries=0) as c:
            out = await c.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=20,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return [chunk async for chunk in out]

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks), "no usage chunk unless stream_options asks for it"


def test_stop_strings_and_seeds_behave_as_on_grpc(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    free = (
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[: free.index(stop)]
    sampled = [
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0.9,
            seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        .choices[0]
        .model_extra["token_ids"]
        for seed in (7, 7)
    ]
    want = grpc_greedy(
        cluster,
        pb.GenerateRequest(
            prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
        ),
    )
    assert sampled == [want.token_ids, want.token_ids]


def test_n_choices_through_the_openai_client(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    """Choice i samples with seed + i: the same tokens as a request of its own with that seed (one
    sequence at a time here, so the completions even run alone); streamed or not, the same."""
    body = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0.9, seed=7, n=3, extra_body=body
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.prompt_tokens == len(PROMPT) and whole.usage.completion_tokens == 30
    for i, c in enumerate(whole.choices):
        want = grpc_greedy(
            cluster,
            pb.GenerateRequest(
                prompt_token_ids=PROMPT,
                sampling=pb.SamplingParams(max_tokens=10, temperature=0.9, seed=7 + i, ignore_eos=True),
            ),
        )
        assert c.model_extra["token_ids"] == want.token_ids and c.finish_reason == "length"
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    alone = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert finished == {0, 1} and texts == {0: alone.choices[0].message.content, 1: alone.choices[0].message.content}


def _grpc_logprobs(cluster: Cluster, req: pb.GenerateRequest) -> tuple[list[int], list[pb.TokenLogprobs]]:
    async def go() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            return [r async for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=HANG_GUARD_S)]

    out = asyncio.run(go())
    return [t for r in out for t in r.token_ids], [e for r in out for e in r.logprobs]


def test_logprobs_over_http_equal_the_grpc_ones(
    cluster: Cluster, client: openai.OpenAI, model: str, tiny_llama: Path
) -> None:
    from transformers import AutoTokenizer

    ids, lps = _grpc_logprobs(
        cluster, greedy(PROMPT, 12, ignore_eos=True, logprobs=3, presence_penalty=0.5, logit_bias={7: 2.0})
    )
    assert len(lps) == 12
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    got = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        presence_penalty=0.5,
        logit_bias={"7": 2.0},
        extra_body={"ignore_eos": True},
    )
    lp = got.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in lps], abs=1e-6)
    assert [set(d) for d in lp.top_logprobs] == [{tok.decode([i]) for i in [*e.top_token_ids, e.token_id]} for e in lps]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(12)]

    streamed = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            logprobs=3,
            presence_penalty=0.5,
            logit_bias={"7": 2.0},
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    s_lps = [x for c in streamed if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert s_lps == pytest.approx([e.logprob for e in lps], abs=1e-6)

    chat_msgs = [{"role": "user", "content": "Name a colour."}]
    c_ids, c_lps = _grpc_logprobs(
        cluster,
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in chat_msgs],
            sampling=pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2),
        ),
    )
    chat = client.chat.completions.create(
        model=model,
        messages=chat_msgs,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in c_lps], abs=1e-6)
    assert [c.token for c in content] == [tok.decode([t]) for t in c_ids]
    assert [t.logprob for c in content for t in c.top_logprobs] == pytest.approx(
        [x for e in c_lps for x in e.top_logprobs], abs=1e-6
    )
    assert all(len(c.top_logprobs) == 2 for c in content)

    async def chat_stream() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="EMPTY", max_retries=0) as c:
            out = await c.chat.completions.create(
                model=model,
                messages=chat_msgs,
                max_tokens=10,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return [x async for x in out]

    chunks = asyncio.run(chat_stream())
    streamed_lps = [
        c.logprob for x in chunks if x.choices and x.choices[0].logprobs for c in x.choices[0].logprobs.content
    ]
    assert streamed_lps == pytest.approx([e.logprob for e in c_lps], abs=1e-6)


def test_models_and_health(cluster: Cluster, client: openai.OpenAI, model: str, tiny_llama: Path) -> None:
    """The id is the model directory (a tokenizer path for tools), ``root`` too; ``max_model_len`` is the
    model's 512-token context (the 40-block pool holds 640); the directory's name is still accepted."""
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model] and listed.data[0].owned_by == "pagedserve"
    card = listed.data[0].model_extra
    assert card["root"] == model and card["max_model_len"] == 512 and card["parent"] is None
    assert client.models.retrieve(model).id == model
    assert client.models.retrieve(tiny_llama.name).id == tiny_llama.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-" + model)
    got = client.completions.create(model=tiny_llama.name, prompt="Hi", max_tokens=2)
    assert got.model == model, "answers report the id, whichever accepted name the request used"
    for method in ("GET", "POST"):
        health = httpx.request(method, f"{cluster.http_url}/ping", timeout=10)
        assert health.status_code == 200 and health.json() == {"status": "serving"}
    health = httpx.get(f"{cluster.http_url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "serving"}
    assert httpx.get(f"{cluster.http_url}/version", timeout=10).json() == {"version": version("pagedserve")}


def test_tokenize_and_detokenize_as_the_completions_endpoints_do(
    cluster: Cluster, client: openai.OpenAI, model: str, tiny_llama: Path
) -> None:
    """vLLM's shapes; the ids are those a completion's prompt gets (``return_token_ids``)."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    with httpx.Client(base_url=cluster.http_url, timeout=HANG_GUARD_S) as h:
        got = h.post("/tokenize", json={"model": model, "prompt": "Hello there, how are"}).json()
        assert got == {
            "count": len(got["tokens"]),
            "max_model_len": 512,
            "tokens": tok("Hello there, how are").input_ids,
            "token_strs": None,
        }
        chat = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=2,
            extra_body={"return_token_ids": True},  # type: ignore[arg-type]
        )
        templated = h.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
        assert templated["tokens"] == chat.model_extra["prompt_token_ids"]
        assert templated["token_strs"] == tok.convert_ids_to_tokens(templated["tokens"])
        bare = h.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert bare["count"] < templated["count"] and templated["tokens"][: bare["count"]] == bare["tokens"]
        back = h.post("/detokenize", json={"model": model, "tokens": got["tokens"]})
        assert back.json() == {"prompt": "Hello there, how are"}
        for path, body, param in (
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": 7}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
            (
                "/tokenize",
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages[0].content[0]",
            ),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
            ("/detokenize", {"tokens": [1, 49152]}, "tokens[1]"),
            ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
        ):
            resp = h.post(path, json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, body, resp.text)
        resp = h.post("/tokenize", json={"model": "gpt-4o", "prompt": "a"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_load_counts_the_completions_in_flight(cluster: Cluster, model: str) -> None:
    """vLLM's ``/load``: a completion counts from its arrival (queued behind a gRPC blocker holding the
    only seat: gRPC calls are not counted) until it is answered; a stream until it ends."""

    async def go() -> list[int]:
        async with (
            grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch,
            httpx.AsyncClient(base_url=cluster.http_url, timeout=HANG_GUARD_S) as h,
        ):
            load = lambda: h.get("/load")  # noqa: E731
            seen = [(await load()).json()["server_load"]]
            blocker = greedy(PROMPT, 400, ignore_eos=True)
            blocker.request_id = "load-blocker"
            call = pb_grpc.GenerationStub(ch).Generate(blocker, timeout=HANG_GUARD_S)
            await call.read()  # it runs
            body = {"model": model, "prompt": "Hi", "max_tokens": 2, "stream": True}
            waiting = asyncio.create_task(h.post("/v1/completions", json=body))
            while (n := (await load()).json()["server_load"]) == 0:
                await asyncio.sleep(0.02)
            seen.append(n)
            await pb_grpc.GenerationStub(ch).Abort(pb.AbortRequest(request_id="load-blocker"))
            assert (await waiting).status_code == 200
            while (await load()).json()["server_load"] != 0:  # the stream's end is counted once it is sent
                await asyncio.sleep(0.02)
            call.cancel()
            return seen

    assert asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S)) == [0, 1]


def test_metrics_on_the_api_port(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    """The scrape of ``--metrics-port``, loop process included, on the HTTP port (no --metrics-port here)."""
    client.completions.create(model=model, prompt="Hi", max_tokens=3)
    resp = httpx.get(f"{cluster.http_url}/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {s.name for f in text_string_to_metric_families(resp.text) for s in f.samples}
    assert {"pagedserve:time_to_first_token_seconds_count", "pagedserve:prompt_tokens_total"} <= names
    assert not any(n.startswith("vllm:") for n in names)


def test_a_replica_with_served_names_and_vllm_metric_names(cluster: Cluster, model: str) -> None:
    """``--served-model-name``: the first is the id, any is accepted, the directory still is, others
    404; ``--metrics-prefix vllm``: the frontend's series under vLLM's names on the API port. A second
    replica of the namespace (API only), as the flags must differ."""
    port = free_port()
    args = ["--role", "frontend", "--http-port", str(port), "--served-model-name", "tiny-chat", "tiny-alias"]
    replica = cluster.start_scheduler([*args, "--metrics-prefix", "vllm"])
    try:
        url = f"http://127.0.0.1:{port}"
        with openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=HANG_GUARD_S) as c:
            listed = c.models.list().data
            assert [m.id for m in listed] == ["tiny-chat", "tiny-alias"]
            assert {m.model_extra["root"] for m in listed} == {model}
            for name in ("tiny-alias", model):
                got = c.completions.create(model=name, prompt="Hi", max_tokens=3, stream=True)
                assert {chunk.model for chunk in got} == {"tiny-chat"}
            with pytest.raises(openai.NotFoundError) as info:
                c.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)
            assert info.value.code == "model_not_found"
        text = httpx.get(f"{url}/metrics", timeout=10).text
        names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        for series in (
            "vllm:time_to_first_token_seconds_count",
            "vllm:inter_token_latency_seconds_count",
            "vllm:time_per_output_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count",
            "pagedserve:num_streams",  # no vLLM counterpart: its own name
        ):
            assert series in names, series
        assert not any(n.startswith("pagedserve:time_to_first") for n in names)
        if prometheus.available():  # the renamed exposition parses, with no finding but vLLM's own naming
            rc, said = prometheus.promtool_check(text)
            assert rc in (0, 3) and all(any(n in line for n in VLLM_NAMING) for line in said.splitlines()), said
    finally:
        cluster.schedulers.remove(replica)
        replica.stop()


def test_litellm_maps_an_overlong_prompt_to_context_window_exceeded(cluster: Cluster, model: str) -> None:
    """litellm keys on the message text (vLLM's shape), as for a vLLM server."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"openai/{model}",
            api_base=f"{cluster.http_url}/v1",
            api_key="EMPTY",
            messages=[{"role": "user", "content": "hello " * 600}],
            max_tokens=5,
            num_retries=0,
        )


def test_guidellm_benchmarks_without_a_tokenizer_argument(cluster: Cluster, tmp_path: Path) -> None:
    """guidellm takes the tokenizer from /v1/models' id (the model directory), as from vLLM."""
    report = tmp_path / "guidellm.json"
    argv = [
        str(Path(sys.executable).parent / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={cluster.http_url}",
        "--profile",
        "kind=synchronous",
        "--constraint",
        "kind=max_requests,count=3",
        "--data",
        "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads(report.read_text())["benchmarks"][0]
    assert bench["scheduler_metrics"]["requests_made"] == {"successful": 3, "errored": 0, "incomplete": 0, "total": 3}


def test_an_executor_refuses_a_max_model_len_its_pool_cannot_hold(tiny_llama: Path) -> None:
    """At start, with the number that fits: 40 blocks of 16 tokens hold 640."""
    argv = [sys.executable, "-m", "executor_svc", "--model", str(tiny_llama), "--port", str(free_port())]
    pool = ["--kv-cache-memory", str(40 * block_bytes(tiny_llama)), "--max-model-len", "1000"]
    done = subprocess.run([*argv, *pool], capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --max-model-len 1000: the KV pool holds 640 tokens (40 blocks of 16), so no request of 1000 "
        "tokens could ever run; use --max-model-len 640 or less, or give the pool more memory "
        "(--kv-cache-memory, --gpu-memory-utilization)"
    )


# --- refusals ---------------------------------------------------------------------

BAD_JSON: list[tuple[str, bytes, str | None]] = [
    ("temperature -1", b'{"prompt": "hi", "temperature": -1}', "temperature"),
    ("temperature NaN", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("max_tokens 0", b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ("max_tokens a string", b'{"prompt": "hi", "max_tokens": "8"}', "max_tokens"),
    ("n over --max-n", b'{"prompt": "hi", "n": 17}', "n"),
    ("top_p 0", b'{"prompt": "hi", "top_p": 0}', "top_p"),
    ("empty stop string", b'{"prompt": "hi", "stop": [""]}', "stop"),
    ("token id out of vocabulary", b'{"prompt": [5, 1000000]}', "prompt"),
    ("prompt over the context", b'{"prompt": [' + b"7," * 599 + b"7]}", "prompt"),
    ("lone surrogate", b'{"prompt": "a\\ud800"}', "prompt"),
    ("presence_penalty 3", b'{"prompt": "hi", "presence_penalty": 3}', "presence_penalty"),
    ("logit_bias out of vocabulary", b'{"prompt": "hi", "logit_bias": {"49152": 1}}', "logit_bias"),
    ("logprobs over --max-logprobs", b'{"prompt": "hi", "logprobs": 21}', "logprobs"),
    ("min_tokens over max_tokens", b'{"prompt": "hi", "max_tokens": 4, "min_tokens": 5}', "min_tokens"),
    ("a batch with an empty prompt", b'{"prompt": ["a", ""]}', "prompt[1]"),
    ("echo a string", b'{"prompt": "a", "echo": "yes"}', "echo"),
    ("max_tokens 0 without echo", b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ("not JSON", b'{"prompt": ', None),
    ("not an object", b'["prompt"]', None),
    ("nested too deep", b"[" * 100_000, None),
    ("not UTF-8", b'{"prompt": "\xff"}', None),
]


def _with_model(raw: bytes, model: str) -> bytes:
    return raw.replace(b"{", b'{"model": "' + model.encode() + b'", ', 1) if raw.startswith(b'{"prompt') else raw


def test_bad_input_is_400_naming_the_field_and_others_go_on(
    cluster: Cluster, client: openai.OpenAI, model: str
) -> None:
    with httpx.Client(base_url=f"{cluster.http_url}/v1", timeout=HANG_GUARD_S) as h:
        for name, raw, param in BAD_JSON:
            resp = h.post("/completions", content=_with_model(raw, model), headers={"Content-Type": "application/json"})
            assert resp.status_code == 400, (name, resp.text)
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (name, error)
            if error["code"] == "context_length_exceeded":  # OpenAI's words, which clients match
                assert error["message"].startswith("This model's maximum context length is"), (name, error)
            else:
                assert param is None or error["message"].startswith(param), (name, error)
        for path, method, status in (("/nowhere", "GET", 404), ("/completions", "GET", 405)):
            resp = h.request(method, path)
            assert resp.status_code == status and "message" in resp.json()["error"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=0)
    assert info.value.param == "n" and "--max-n" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=-1)
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert info.value.code == "model_not_found" and info.value.status_code == 404
    after = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert after.choices[0].model_extra["token_ids"] == grpc_greedy(cluster, greedy(PROMPT, 6)).token_ids


def test_an_overlong_prompt_is_openai_s_context_length_exceeded(client: openai.OpenAI, model: str) -> None:
    """The code litellm maps to ContextWindowExceededError, and OpenAI's (and vLLM's) message."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[7] * 600, max_tokens=5)
    error = info.value.body  # the error object (the SDK's .message prefixes "Error code: 400 - ")
    assert isinstance(error, dict) and info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert error["message"] == (
        "This model's maximum context length is 512 tokens. However, you requested 605 tokens "
        "(600 in the messages, 5 in the completion). Please reduce the length of the messages or completion."
    )
    with pytest.raises(openai.BadRequestError) as info:  # too long once tokenized: the frontend's check
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello " * 2000}])
    error = info.value.body
    assert isinstance(error, dict) and info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert error["message"].startswith("This model's maximum context length is 512 tokens. However, you requested")


def test_over_max_pending_requests_is_429_with_retry_after(
    cluster: Cluster,
    model: str,
    rclient: redis.Redis,
) -> None:
    """A blocker holds the only seat; two requests wait; a third is refused 429 with
    Retry-After; one waiting client hangs up (its request leaves the queue), which makes room
    for another; the accepted ones complete token-identical."""
    keys, prompts = Keys(NS), [PROMPT[i:] + [7] * i for i in (1, 2, 3)]

    async def go() -> tuple[list[Any], openai.RateLimitError]:
        async with (
            grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch,
            openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="EMPTY", max_retries=0) as c,
        ):
            stub = pb_grpc.GenerationStub(ch)
            blocker = greedy(PROMPT, 400, ignore_eos=True)
            blocker.request_id = "http-blocker"
            call = stub.Generate(blocker, timeout=HANG_GUARD_S)
            await call.read()  # it runs

            def ask(prompt: list[int], rid: str) -> asyncio.Task[Any]:
                return asyncio.create_task(
                    c.completions.create(
                        model=model,
                        prompt=prompt,
                        max_tokens=8,
                        temperature=0,
                        extra_headers={"X-Request-Id": rid},
                        extra_body={"ignore_eos": True, "return_token_ids": True},
                    )
                )

            first, leaving = ask(prompts[0], "waits-1"), ask(prompts[1], "leaves")
            await until(lambda: rclient.zcard(keys.queue) == MAX_PENDING, "two requests queued")
            with pytest.raises(openai.RateLimitError) as refused:
                await c.completions.create(model=model, prompt=prompts[2], max_tokens=8)
            leaving.cancel()  # the client hangs up while its request waits
            await until(lambda: rclient.hget(keys.req("leaves"), "finish_reason") == "abort", "it was aborted")
            assert rclient.zcard(keys.queue) == 1
            with pytest.raises(openai.APIStatusError) as late:  # its queue_timeout passes before it starts
                await c.completions.create(
                    model=model, prompt=prompts[2], max_tokens=8, extra_body={"queue_timeout": 0.3}
                )
            assert late.value.status_code == 504 and late.value.code == "queue_timeout"
            assert late.value.response.headers["x-should-retry"] == "false"
            second = ask(prompts[2], "waits-2")
            await until(lambda: rclient.zcard(keys.queue) == MAX_PENDING, "room again")
            await stub.Abort(pb.AbortRequest(request_id="http-blocker"))
            return list(await asyncio.gather(first, second)), refused.value

    done, refused = asyncio.run(go())
    assert refused.status_code == 429 and refused.code == "rate_limit_exceeded"
    retry_after = refused.response.headers["retry-after"]
    assert retry_after.isdigit() and int(retry_after) >= 1 and "--max-pending-requests" in refused.message
    want = run_all(cluster.address, [greedy(prompts[0], 8, ignore_eos=True), greedy(prompts[2], 8, ignore_eos=True)])
    assert [d.choices[0].model_extra["token_ids"] for d in done] == [w.token_ids for w in want]
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def test_a_client_that_hangs_up_mid_stream_aborts_its_request(
    cluster: Cluster, model: str, rclient: redis.Redis
) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=HANG_GUARD_S) as h,
        h.stream("POST", f"{cluster.http_url}/v1/completions", json=body, headers={"X-Request-Id": "hangs-up"}) as resp,
    ):
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"] == "hangs-up"
        events = sse_events(resp.iter_lines())  # held: closing it would hang up at once
        first = next(events)
        assert first["id"] == "cmpl-hangs-up" and first["choices"][0]["finish_reason"] is None
        assert rclient.sismember(Keys(NS).live, "hangs-up")
        again = h.post(f"{cluster.http_url}/v1/completions", json=body, headers={"X-Request-Id": "hangs-up"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_request_id"
        assert again.headers["x-should-retry"] == "false"
    wait_until(lambda: rclient.hget(Keys(NS).req("hangs-up"), "finish_reason") is not None, 30, "the abort")
    assert rclient.hget(Keys(NS).req("hangs-up"), "finish_reason") == "abort"
    assert rclient.llen(Keys(NS).out("hangs-up")) < 400
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def test_a_batch_whose_later_prompt_is_refused_aborts_those_queued(
    cluster: Cluster, model: str, rclient: redis.Redis
) -> None:
    """A batch is admitted all or none: prompt 1's id (``<id>-1``) is a live request's, so the
    answer is 409 and prompt 0, queued already, is aborted."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    url = f"{cluster.http_url}/v1/completions"
    with (
        httpx.Client(timeout=HANG_GUARD_S) as h,
        h.stream("POST", url, json=body, headers={"X-Request-Id": "batch-1"}) as resp,
    ):
        events = sse_events(resp.iter_lines())  # held: a dropped generator closes the stream, aborting batch-1
        next(events)
        batch = {"model": model, "prompt": ["a", "b"], "max_tokens": 2}
        refused = h.post(url, json=batch, headers={"X-Request-Id": "batch"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "duplicate_request_id"
        wait_until(lambda: rclient.hget(Keys(NS).req("batch-0"), "finish_reason") is not None, 30, "the abort")
        assert rclient.hget(Keys(NS).req("batch-0"), "finish_reason") == "abort"
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def test_a_draining_replica_ends_its_streams_with_where_to_resume(cluster: Cluster, model: str) -> None:
    """SIGTERM on a second replica mid-stream: an error event names the request and offset,
    no ``[DONE]``; gRPC Resume on the first replica delivers the rest, every token once."""
    port = free_port()
    replica = cluster.start_scheduler(["--http-port", str(port), "--max-num-seqs", "1"])
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    try:
        with (
            httpx.Client(timeout=HANG_GUARD_S) as h,
            h.stream(
                "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, headers={"X-Request-Id": "drained"}
            ) as resp,
        ):
            events = list(_read_until_signalled(sse_events(resp.iter_lines()), replica.proc.pid, tokens))
        assert replica.proc.wait(30) == 0
    finally:
        replica.stop()
        cluster.schedulers.remove(replica)
    error = events[-1]["error"]
    assert (error["code"], error["request_id"], error["offset"]) == ("stream_detached", "drained", len(tokens))
    assert "[DONE]" not in events
    with grpc.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
        rest = list(
            pb_grpc.GenerationStub(ch).Resume(
                pb.ResumeRequest(request_id="drained", offset=error["offset"]), timeout=HANG_GUARD_S
            )
        )
    assert rest[-1].finish_reason == "length"
    assert tokens + [t for r in rest for t in r.token_ids] == grpc_greedy(cluster, greedy(PROMPT, 120)).token_ids


def _read_until_signalled(events: Iterator[Any], pid: int, tokens: list[int]) -> Iterator[Any]:
    """Pass the events on, collecting token ids; SIGTERM ``pid`` after the first."""
    for event in events:
        if isinstance(event, dict) and "choices" in event:
            tokens += event["choices"][0]["token_ids"]
            if len(tokens) == len(event["choices"][0]["token_ids"]):
                os.kill(pid, signal.SIGTERM)
        yield event


# --- keys and TLS -----------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> devcerts.DevCerts:
    out = devcerts.write(tmp_path_factory.mktemp("certs"))
    out.api_keys.write_text(f"# two keys during a rotation\n{KEYS[0]}\n{KEYS[1]}\n")
    return out


@pytest.fixture(scope="module")
def secure(
    templated: Path, redis_url: str, certs: devcerts.DevCerts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with make_cluster(
        templated,
        redis_url,
        SECURE_NS,
        tmp_path_factory.mktemp("logs"),
        tls=certs,
        api_key_file=certs.api_keys,
        http_port=free_port(),
    ) as c:
        yield c


def _trusting(certs: devcerts.DevCerts) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs.ca_cert))


def test_api_keys_guard_everything_but_health(secure: Cluster, certs: devcerts.DevCerts, model: str) -> None:
    assert secure.http_url is not None and secure.http_url.startswith("https://")
    base = f"{secure.http_url}/v1"
    with openai.OpenAI(
        base_url=base, api_key="wrong-key", max_retries=0, http_client=httpx.Client(verify=_trusting(certs))
    ) as c:
        with pytest.raises(openai.AuthenticationError) as info:
            c.completions.create(model=model, prompt="hi", max_tokens=2)
        assert info.value.code == "invalid_api_key"
        assert info.value.response.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    for key in KEYS:
        with openai.OpenAI(
            base_url=base, api_key=key, max_retries=0, http_client=httpx.Client(verify=_trusting(certs))
        ) as c:
            got = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
            )
            assert got.choices[0].finish_reason in ("stop", "length")
    with httpx.Client(verify=_trusting(certs)) as h:  # no key at all, or not as a bearer token
        assert h.get(f"{secure.http_url}/health").status_code == 200
        for headers in ({}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": "Bearer"}):
            for method, path in (("GET", "/models"), ("POST", "/chat/completions")):
                resp = h.request(method, base + path, headers=headers, json={"model": model})
                assert resp.status_code == 401, (headers, path)
                assert resp.json()["error"]["code"] == "invalid_api_key"


def test_the_http_port_speaks_https_only(secure: Cluster, certs: devcerts.DevCerts) -> None:
    assert secure.http_url is not None
    plain = secure.http_url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/health", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{secure.http_url}/health", timeout=10)  # the system's roots do not know the dev CA


def _served_serial(url: str, ca: Path) -> int:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        ssl.create_default_context(cafile=str(ca)).wrap_socket(raw, server_hostname=host) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_the_https_certificate_reloads_without_a_restart(secure: Cluster, certs: devcerts.DevCerts) -> None:
    assert secure.http_url is not None
    pid = secure.scheduler.proc.pid
    serial = lambda: x509.load_pem_x509_certificate(certs.scheduler_cert.read_bytes()).serial_number  # noqa: E731
    assert _served_serial(secure.http_url, certs.ca_cert) == serial()
    ca, ca_key = devcerts.load_ca(certs)
    devcerts.write_leaf(certs.scheduler_cert, certs.scheduler_key, ca, ca_key, "scheduler", ["127.0.0.1"])
    assert _served_serial(secure.http_url, certs.ca_cert) == serial()
    os.kill(pid, signal.SIGHUP)  # as an operator would: nothing more changes, nothing dies
    assert _served_serial(secure.http_url, certs.ca_cert) == serial()
    with httpx.Client(verify=_trusting(certs)) as h:
        assert h.get(f"{secure.http_url}/health").status_code == 200
    assert secure.scheduler.proc.pid == pid and secure.scheduler.proc.poll() is None


def test_the_ssl_context_keeps_a_mismatched_pair_out(tmp_path: Path) -> None:
    """The pure part: reload on change or request; a certificate whose key has not arrived
    yet is not loaded."""
    out = devcerts.write(tmp_path / "c")
    tls = ReloadingSSLContext(out.scheduler_cert, out.scheduler_key)
    first = tls.current()
    assert tls.current() is first
    tls.request_reload()
    second = tls.current()
    assert second is not first and tls.current() is second
    ca, ca_key = devcerts.load_ca(out)
    cert, _ = devcerts.make_leaf(ca, ca_key, "scheduler", ["127.0.0.1"])
    from cryptography.hazmat.primitives import serialization

    out.scheduler_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    assert tls.current() is second, "a certificate without its key: the current pair stays"
    devcerts.write_leaf(out.scheduler_cert, out.scheduler_key, ca, ca_key, "scheduler", ["127.0.0.1"])
    assert tls.current() is not second
    with pytest.raises(ValueError, match="--tls-key"):
        ReloadingSSLContext(out.scheduler_cert, out.executor_key)


# --- vLLM's fields (issue #22): each honoured (a behavioural test) or refused by name -------------

# From vLLM's source, vllm-project/vllm at commit 002032ee2b18e1f7bd924ec47b62504ba3866063:
# ChatCompletionRequest in vllm/entrypoints/openai/chat_completion/protocol.py,
# CompletionRequest in vllm/entrypoints/openai/completion/protocol.py, in their order.
VLLM_CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "thinking_token_budget",
    "include_reasoning", "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty",
    "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_prompt_text", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "stream_interval",
]  # fmt: skip
VLLM_COMPLETION_FIELDS = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval",
]  # fmt: skip
# Earlier vLLM versions' (vllm/entrypoints/openai/protocol.py) and OpenAI's that the lists above dropped.
OLDER_FIELDS = ["best_of", "logits_processors", "functions"]

# Honoured: the test that shows each one's effect ("module::test").
HONOURED = {
    "messages": "test_http::test_chat_completions_match_the_grpc_api",
    "prompt": "test_http::test_completions_match_the_grpc_api_token_for_token",
    "model": "test_http::test_bad_input_is_400_naming_the_field_and_others_go_on",
    "max_tokens": "test_http::test_completions_match_the_grpc_api_token_for_token",
    "max_completion_tokens": "test_http::test_chat_completions_match_the_grpc_api",
    "ignore_eos": "test_http::test_completions_match_the_grpc_api_token_for_token",
    "return_token_ids": "test_http::test_completions_match_the_grpc_api_token_for_token",
    "stream": "test_http::test_completions_match_the_grpc_api_token_for_token",
    "stream_options": "test_http::test_completions_match_the_grpc_api_token_for_token",
    "seed": "test_http::test_stop_strings_and_seeds_behave_as_on_grpc",
    "stop": "test_http::test_stop_strings_and_seeds_behave_as_on_grpc",
    "temperature": "test_http::test_stop_strings_and_seeds_behave_as_on_grpc",
    "n": "test_http::test_n_choices_through_the_openai_client",
    "logprobs": "test_http::test_logprobs_over_http_equal_the_grpc_ones",
    "top_logprobs": "test_http::test_logprobs_over_http_equal_the_grpc_ones",
    "prompt_logprobs": "test_http::test_logprobs_over_http_equal_the_grpc_ones",
    "cache_salt": "test_http::test_cache_salt_and_cached_tokens",
    "response_format": "test_structured_output::test_openai_client_response_format_json_schema",
    "structured_outputs": "test_structured_output::test_openai_client_response_format_json_schema",
    "stop_token_ids": "test_api::test_stop_strings_and_stop_token_ids",
    "priority": "test_preemption::test_priority_request_jumps_a_full_pool",
    **dict.fromkeys(
        [
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "min_p",
            "top_k",
            "top_p",
            "logit_bias",
            "min_tokens",
        ],
        "test_sampling::test_seeded_sampling_with_every_option_survives_preemption",
    ),
    "include_stop_str_in_output": "test_http::test_include_stop_str_in_output_keeps_the_stop_string",
    "allowed_token_ids": "test_http::test_allowed_token_ids_and_bad_words_mask_the_output",
    "bad_words": "test_http::test_allowed_token_ids_and_bad_words_mask_the_output",
    "add_generation_prompt": "test_http::test_chat_template_fields_render_the_prompt",
    "continue_final_message": "test_http::test_chat_template_fields_render_the_prompt",
    "chat_template_kwargs": "test_http::test_chat_template_fields_render_the_prompt",
    "truncate_prompt_tokens": "test_http::test_truncate_prompt_tokens_keeps_the_last_k",
    "request_id": "test_http::test_a_body_request_id_names_the_request",
    "tools": "test_tools::test_required_calls_a_tool_with_arguments_that_match_its_schema",
    "tool_choice": "test_tools::test_a_named_function_is_called_streamed_or_not",
    "parallel_tool_calls": "test_tools::test_required_calls_a_tool_with_arguments_that_match_its_schema",
    # /v1/completions (a 400 naming it on chat, where vLLM's echo repeats the last message: not honoured yet)
    "echo": "test_http_batch::test_echo_puts_the_prompt_in_front_streamed_or_not",
}
# Accepted with any value: it changes nothing about generation by definition.
NO_EFFECT = {"user": "an end user's id for the provider's abuse monitoring (vLLM ignores it too)"}
# Refused (400 naming it) at these values; their off values are accepted (openai_request.NOT_YET).
REFUSED: dict[str, Any] = {
    "functions": [{"name": "f"}],
    "reasoning_effort": "low",
    "thinking_token_budget": 10,
    "include_reasoning": False,
    "use_beam_search": True,
    "best_of": 2,
    "watermarking": True,
    "length_penalty": 0.5,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncation_side": "right",
    "logprob_token_ids": [1],
    "add_special_tokens": None,  # the other value than each endpoint's default (below)
    "documents": [{"title": "a", "text": "b"}],
    "chat_template": "{{ messages }}",
    "media_io_kwargs": {"image": {"a": 1}},
    "mm_processor_kwargs": {"a": 1},
    "session_id": "s",
    "return_tokens_as_token_ids": True,
    "routed_experts_prompt_start": 1,
    "return_token_offsets": True,
    "return_prompt_text": True,
    "return_mm_kwargs": False,
    "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "stream_interval": 4,
    "suffix": "end",
    "prompt_embeds": "AAAA",
    "logits_processors": ["my.Processor"],
}


def test_every_vllm_field_is_honoured_or_refused_by_name(cluster: Cluster, model: str) -> None:
    """The field walk: each of vLLM's request fields is honoured (a test shows its effect), or sent
    at a value that is not its off value is a 400 naming it; never a 200 that ignored it."""
    tables = (HONOURED, NO_EFFECT, REFUSED)
    assert all(a.keys().isdisjoint(b.keys()) for i, a in enumerate(tables) for b in tables[i + 1 :])
    sources = {
        m: (Path(__file__).parent / f"{m}.py").read_text() for m in {w.split("::")[0] for w in HONOURED.values()}
    }
    for field, where in HONOURED.items():
        module, test = where.split("::")
        assert f"def {test}(" in sources[module], (field, where)
    bases = {
        True: ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, VLLM_CHAT_FIELDS),
        False: ("/completions", {"prompt": PROMPT}, VLLM_COMPLETION_FIELDS),
    }
    with httpx.Client(base_url=f"{cluster.http_url}/v1", timeout=HANG_GUARD_S) as h:
        for chat, (path, base, fields) in bases.items():
            base = {"model": model, "max_tokens": 1, "temperature": 0, **base}
            for field in [*fields, *OLDER_FIELDS]:
                assert field in HONOURED or field in NO_EFFECT or field in REFUSED, (
                    f"{field}: neither honoured nor refused"
                )
                if field in NO_EFFECT:
                    assert h.post(path, json={**base, field: "x"}).status_code == 200, field
                if field not in REFUSED:
                    continue
                value = chat if field == "add_special_tokens" else REFUSED[field]
                resp = h.post(path, json={**base, field: value})
                assert resp.status_code == 400, (path, field, resp.text)
                error = resp.json()["error"]
                assert error["param"] == field and error["message"].startswith(field + ":"), (path, field, error)


def _tokens(got: Any) -> list[int]:
    return got.choices[0].model_extra["token_ids"]


def test_include_stop_str_in_output_keeps_the_stop_string(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    body = {"ignore_eos": True}
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0, extra_body=body)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = text[: text.index(stop) + len(stop)]
    kept = {**body, "include_stop_str_in_output": True}
    got = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], extra_body=kept
    ).choices[0]
    assert got.finish_reason == "stop" and got.text == want and got.text.endswith(stop)
    streamed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], stream=True, extra_body=kept
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    grpc_req = greedy(PROMPT, 30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert grpc_greedy(cluster, grpc_req).text == want


def _vllm_bad_words(tokenizer: Any, word: str) -> list[list[int]]:
    """vLLM's rule, written out here: the word as written and with a leading space (if that is another
    first token of the same length)."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    return [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])


def _has(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def test_allowed_token_ids_and_bad_words_mask_the_output(
    cluster: Cluster, client: openai.OpenAI, model: str, templated: Path
) -> None:
    """Greedy and seeded sampling, over HTTP and gRPC alike: only allowed ids come out, and no bad word."""
    free = grpc_greedy(cluster, greedy(PROMPT, 16, ignore_eos=True)).token_ids
    allowed = sorted({free[3], free[7], 1000, 2000, 3000} - {free[0]})
    body = {"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed}
    for temperature, seed in ((0.0, None), (1.0, 11)):
        got = _tokens(
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=16, temperature=temperature, seed=seed, extra_body=body
            )
        )
        sampling = pb.SamplingParams(
            max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True, allowed_token_ids=allowed
        )
        assert set(got) <= set(allowed) and got != free
        assert got == grpc_greedy(cluster, pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling)).token_ids

    tokenizer = AutoTokenizer.from_pretrained(templated)
    words = [w for t in free if (w := tokenizer.decode([t]).strip()).isalpha()]
    word = next(w for w in words if any(_has(free, s) for s in _vllm_bad_words(tokenizer, w)))
    banned = _vllm_bad_words(tokenizer, word)
    body = {"ignore_eos": True, "return_token_ids": True, "bad_words": [word]}
    for temperature, seed in ((0.0, None), (1.0, 11)):
        got = _tokens(
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=16, temperature=temperature, seed=seed, extra_body=body
            )
        )
        sampling = pb.SamplingParams(
            max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True, bad_words=[word]
        )
        assert not any(_has(got, s) for s in banned), (word, banned, got)
        assert got == grpc_greedy(cluster, pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling)).token_ids
    assert got != free


def test_chat_template_fields_render_the_prompt(
    cluster: Cluster, client: openai.OpenAI, model: str, templated: Path
) -> None:
    """Each setting renders another prompt (the template run here says which), which the request's
    prompt tokens and its greedy output, over HTTP and over gRPC, follow."""
    tokenizer = AutoTokenizer.from_pretrained(templated)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    cases: list[dict[str, Any]] = [
        {},
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        {"chat_template_kwargs": {"house_style": "Be terse."}},
    ]
    prompts = []
    for fields in cases:
        rendered = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=fields.get("add_generation_prompt", not fields.get("continue_final_message")),
            continue_final_message=fields.get("continue_final_message", False),
            tokenize=False,
            **fields.get("chat_template_kwargs", {}),
        )
        ids = tokenizer(rendered, add_special_tokens=False).input_ids
        prompts.append(ids)
        got = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, **fields},
        )
        assert got.usage is not None and got.usage.prompt_tokens == len(ids), fields
        want = grpc_greedy(cluster, greedy(ids, 8, ignore_eos=True)).token_ids
        assert _tokens(got) == want, fields
        req = pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in messages],
            sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        )
        req.MergeFrom(pb.GenerateRequest(**{k: v for k, v in fields.items() if k != "chat_template_kwargs"}))
        req.chat_template_kwargs.update(fields.get("chat_template_kwargs", {}))
        assert grpc_greedy(cluster, req).token_ids == want, fields
    assert len({tuple(p) for p in prompts}) == len(cases), "each setting renders another prompt"
    assert tokenizer.decode(prompts[2]).endswith("The colour is"), "continued: no end of turn"
    for fields, param in (
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=fields)
        assert info.value.param == param


def test_truncate_prompt_tokens_keeps_the_last_k(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    body = {"ignore_eos": True, "return_token_ids": True}
    for keep, kept in ((10, PROMPT[-10:]), (-1, PROMPT)):  # -1: as many as max_model_len - max_tokens (all 40)
        got = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={**body, "truncate_prompt_tokens": keep}
        )
        want = grpc_greedy(cluster, greedy(kept, 8, ignore_eos=True))
        assert got.usage is not None and got.usage.prompt_tokens == len(kept)
        assert _tokens(got) == want.token_ids
        req = greedy(PROMPT, 8, ignore_eos=True)
        req.truncate_prompt_tokens = keep
        assert grpc_greedy(cluster, req).token_ids == want.token_ids
    assert want.token_ids != grpc_greedy(cluster, greedy(PROMPT[-10:], 8, ignore_eos=True)).token_ids
    longer = list(range(300, 900))  # 600 tokens, past the 512-token context: only truncated do they fit
    got = client.completions.create(
        model=model, prompt=longer, max_tokens=8, temperature=0, extra_body={**body, "truncate_prompt_tokens": 20}
    )
    assert _tokens(got) == grpc_greedy(cluster, greedy(longer[-20:], 8, ignore_eos=True)).token_ids
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=8, extra_body={"truncate_prompt_tokens": 600})
    assert info.value.param == "truncate_prompt_tokens"


def test_a_body_request_id_names_the_request(client: openai.OpenAI, model: str) -> None:
    """vLLM's body request_id follows X-Request-Id's rules; with both, they must agree."""
    raw = client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=2, extra_body={"request_id": "from-the-body"}
    )
    assert raw.headers["X-Request-Id"] == "from-the-body" and raw.parse().id == "cmpl-from-the-body"
    same = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=2,
        extra_body={"request_id": "same-in-both"},
        extra_headers={"X-Request-Id": "same-in-both"},
    )
    assert same.id == "cmpl-same-in-both"
    for extra, headers in (({"request_id": "a"}, {"X-Request-Id": "b"}), ({"request_id": "bad\tid"}, {})):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=extra, extra_headers=headers)
        assert info.value.param == "request_id"
