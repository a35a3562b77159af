"""The public API's contract on a real deployment (tiny Llama, real Redis and gRPC):
bad input gets a clear status naming the field while other requests go on,
aborts and client cancellations free every block, seeds reproduce, text
streams join to the decoded completion, stop conditions end requests."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest
import redis
from transformers import AutoTokenizer

from pagedserve.dev.launch import Cluster
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import greedy, run_all, wait_all_free

NS = "tiny"
PROMPT = list(range(100, 140))


@pytest.fixture()
def stub(tiny_cluster: Cluster):
    with grpc.insecure_channel(tiny_cluster.address, options=CHANNEL_OPTIONS) as ch:
        yield pb_grpc.GenerationStub(ch)


@pytest.fixture()
def rclient(redis_url: str):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def _code(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=60))
    return info.value.code(), info.value.details()


S = pb.SamplingParams
INVALID = [
    ("no prompt", pb.GenerateRequest(sampling=S(max_tokens=4)), "prompt"),
    ("two prompt fields", pb.GenerateRequest(prompt="hi", prompt_token_ids=[5, 6]), "prompt_token_ids"),
    (
        "prompt and messages",
        pb.GenerateRequest(prompt="hi", messages=[pb.ChatMessage(role="user", content="x")]),
        "messages",
    ),
    ("max_tokens 0", pb.GenerateRequest(prompt="hi", sampling=S(max_tokens=0)), "max_tokens"),
    ("negative temperature", pb.GenerateRequest(prompt="hi", sampling=S(temperature=-0.5)), "temperature"),
    ("top_p 0", pb.GenerateRequest(prompt="hi", sampling=S(top_p=0.0)), "top_p"),
    ("top_p above 1", pb.GenerateRequest(prompt="hi", sampling=S(top_p=1.5)), "top_p"),
    ("negative top_k", pb.GenerateRequest(prompt="hi", sampling=S(top_k=-1)), "top_k"),
    ("prompt over context", pb.GenerateRequest(prompt_token_ids=[7] * 600), "prompt_token_ids"),
    ("token id out of vocabulary", pb.GenerateRequest(prompt_token_ids=[5, 10**6]), "prompt_token_ids"),
    ("empty stop string", pb.GenerateRequest(prompt="hi", sampling=S(stop=[""])), "stop"),
    ("message without role", pb.GenerateRequest(messages=[pb.ChatMessage(content="x")]), "role"),
]


def test_invalid_input_is_rejected_while_others_continue(tiny_cluster: Cluster, stub, rclient) -> None:
    # A long request runs during all the bad ones and must finish unharmed.
    background: list = []
    worker = threading.Thread(
        target=lambda: background.extend(run_all(tiny_cluster.address, [greedy(PROMPT, 120, ignore_eos=True)]))
    )
    worker.start()
    for name, req, field in INVALID:
        code, details = _code(stub, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, name
        assert field in details, f"{name}: {details!r} does not name {field}"
    worker.join(120)
    assert background and background[0].completion_tokens == 120
    assert background[0].finish_reason == "length"
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def test_request_larger_than_pool_is_resource_exhausted(stub) -> None:
    # The pool holds 24 blocks (384 tokens); 300 + 200 tokens fit the 512-token context but not the pool.
    code, details = _code(stub, pb.GenerateRequest(prompt_token_ids=[9] * 300, sampling=S(max_tokens=200)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_tokens" in details
    ok = pb.GenerateRequest(prompt_token_ids=[9] * 300, sampling=S(max_tokens=20, temperature=0))
    assert [r.finish_reason for r in stub.Generate(ok, timeout=60)][-1] == "length"


def test_abort_ends_stream_and_frees_blocks(tiny_cluster: Cluster, stub, rclient) -> None:
    req = greedy(PROMPT, 300, ignore_eos=True)
    req.request_id = "to-abort"
    stream = stub.Generate(req, timeout=60)
    first = next(stream)
    assert first.request_id == "to-abort" and first.token_ids
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) < 300
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    assert not stub.Abort(pb.AbortRequest(request_id="never-existed")).found
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def test_client_cancellation_frees_blocks(tiny_cluster: Cluster, rclient) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(tiny_cluster.address, options=CHANNEL_OPTIONS) as ch:
            call = pb_grpc.GenerationStub(ch).Generate(greedy(PROMPT, 300, ignore_eos=True))
            async for resp in call:
                assert resp.token_ids
                break
            # The request is live when the client leaves (checked before: the abort may land at once).
            assert rclient.scard(Keys(NS).live) >= 1
            call.cancel()

    asyncio.run(go())
    free, totals = wait_all_free(rclient, NS)
    assert free == totals
    assert rclient.scard(Keys(NS).live) == 0


def test_seeded_sampling_is_reproducible(tiny_cluster: Cluster) -> None:
    def sampled(seed: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=S(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=seed, ignore_eos=True),
        )

    a, b, c = run_all(tiny_cluster.address, [sampled(7), sampled(7), sampled(8)])
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == 24
    assert a.token_ids != c.token_ids
    greedy_run = run_all(tiny_cluster.address, [greedy(PROMPT, 24, ignore_eos=True)])[0]
    assert a.token_ids != greedy_run.token_ids, "temperature 0.9 should not reproduce greedy decoding"


def test_streamed_text_joins_to_decoded_completion(tiny_cluster: Cluster, tiny_llama) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    reqs = [
        pb.GenerateRequest(prompt="Hello there, how are", sampling=S(max_tokens=40, temperature=0, ignore_eos=True)),
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Say something")],
            sampling=S(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True),
        ),
    ]
    for res in run_all(tiny_cluster.address, reqs):
        assert res.chunks > 1
        assert res.text == tok.decode(res.token_ids, skip_special_tokens=True)
        assert res.request_id  # assigned by the server


def test_stop_strings_and_stop_token_ids(tiny_cluster: Cluster, tiny_llama) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    free_run = run_all(tiny_cluster.address, [greedy(PROMPT, 30, ignore_eos=True)])[0]
    full = tok.decode(free_run.token_ids, skip_special_tokens=True)
    # A stop string taken from the middle of the unconstrained output.
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    by_text, by_token = run_all(
        tiny_cluster.address,
        [
            greedy(PROMPT, 30, ignore_eos=True, stop=[stop]),
            greedy(PROMPT, 30, ignore_eos=True, stop_token_ids=[free_run.token_ids[5]]),
        ],
    )
    assert by_text.finish_reason == "stop"
    assert by_text.text == full[: full.index(stop)]
    assert by_text.token_ids == free_run.token_ids[: len(by_text.token_ids)]
    first = free_run.token_ids.index(free_run.token_ids[5])
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == free_run.token_ids[: first + 1]


def test_duplicate_live_request_id_is_refused(tiny_cluster: Cluster, stub, rclient) -> None:
    req = greedy(PROMPT, 300, ignore_eos=True)
    req.request_id = "dup"
    stream = stub.Generate(req, timeout=60)
    next(stream)
    code, details = _code(stub, req)
    assert code == grpc.StatusCode.ALREADY_EXISTS and "request_id" in details
    stream.cancel()
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def test_resume_replays_a_finished_request_from_any_offset(tiny_cluster: Cluster, stub, tiny_llama) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    req = pb.GenerateRequest(
        request_id="done-once", prompt="Hello there, how are", sampling=S(max_tokens=30, temperature=0, ignore_eos=True)
    )
    original = list(stub.Generate(req, timeout=60))
    tokens = [t for r in original for t in r.token_ids]
    offsets = [r.offset for r in original]
    assert offsets == [sum(len(r.token_ids) for r in original[:i]) for i in range(len(original))]
    whole = list(stub.Resume(pb.ResumeRequest(request_id="done-once"), timeout=60))
    assert [t for r in whole for t in r.token_ids] == tokens
    assert "".join(r.text for r in whole) == "".join(r.text for r in original)
    assert whole[-1].finish_reason == "length" and whole[-1].completion_tokens == 30
    tail = list(stub.Resume(pb.ResumeRequest(request_id="done-once", offset=12), timeout=60))
    assert tail[0].offset == 12 and [t for r in tail for t in r.token_ids] == tokens[12:]
    assert tok.decode(tokens[:12]) + "".join(r.text for r in tail) == tok.decode(tokens)
    end = list(stub.Resume(pb.ResumeRequest(request_id="done-once", offset=30), timeout=60))
    assert [(list(r.token_ids), r.offset, r.finish_reason) for r in end] == [([], 30, "length")]
    for bad, code in (
        (pb.ResumeRequest(request_id="never-existed"), grpc.StatusCode.NOT_FOUND),
        # A group's completion that never got in (the replica died before admitting it) is not there either: the
        # resuming client submits on NOT_FOUND (chaos seed 1 found OUT_OF_RANGE here, which reached the caller).
        (pb.ResumeRequest(request_id="never-existed", index=1), grpc.StatusCode.NOT_FOUND),
        (pb.ResumeRequest(request_id="done-once", index=1), grpc.StatusCode.OUT_OF_RANGE),
        (pb.ResumeRequest(request_id="done-once", offset=31), grpc.StatusCode.OUT_OF_RANGE),
        (pb.ResumeRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Resume(bad, timeout=60))
        assert info.value.code() == code


def test_a_sampled_request_without_a_seed_gets_one_stored(tiny_cluster: Cluster, stub, rclient) -> None:
    req = pb.GenerateRequest(
        request_id="unseeded", prompt_token_ids=PROMPT, sampling=S(max_tokens=16, temperature=0.9, ignore_eos=True)
    )
    first = [t for r in stub.Generate(req, timeout=60) for t in r.token_ids]
    seed = json.loads(rclient.hget(Keys(NS).req("unseeded"), "spec"))["params"]["seed"]
    assert isinstance(seed, int)
    again = pb.GenerateRequest(
        prompt_token_ids=PROMPT, sampling=S(max_tokens=16, temperature=0.9, ignore_eos=True, seed=seed)
    )
    assert [t for r in stub.Generate(again, timeout=60) for t in r.token_ids] == first
