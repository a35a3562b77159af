"""Admission control, queue deadlines, caps and malformed requests on a real
deployment (tiny Llama, real Redis and gRPC).

One executor runs one sequence at a time (``--max-num-seqs 1``), so a long
request ahead (the blocker) keeps everything behind it in the shared queue for
as long as the test needs; the blocker is aborted when the test is done with it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from executor_svc.server import add_to_server as add_executor_service
from pagedserve.dev.launch import Cluster
from pagedserve.executor.v1 import executor_pb2 as xpb
from pagedserve.executor.v1 import executor_pb2_grpc as xpb_grpc
from pagedserve.keys import Keys
from pagedserve.members import now_ms
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.core.request import Params, Request
from scheduler_svc.state.store import Expiry, Overloaded, RedisStore
from tests.conftest import make_cluster
from tests.helpers import Result, greedy, until, wait_all_free
from tests.test_e2e_oracle import hf_greedy

NS = "admission"
MAX_PENDING = 2
PROMPTS = [list(range(200 + 17 * i, 230 + 17 * i)) for i in range(4)]
HANG_GUARD_S = 120  # only against a hang: nothing here is timed
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    args = [
        "--max-num-seqs",
        "1",
        "--max-pending-requests",
        str(MAX_PENDING),
        "--max-stop-strings",
        "2",
        "--max-stop-string-length",
        "8",
        "--max-prompt-bytes",
        "256",
        "--max-request-bytes",
        "8192",
    ]
    with make_cluster(
        tiny_llama,
        redis_url,
        NS,
        tmp_path_factory.mktemp("logs"),
        blocks=40,
        scheduler_args=args,
    ) as c:
        yield c


@pytest.fixture()
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


async def collect(
    stub: pb_grpc.GenerationStub,
    req: pb.GenerateRequest,
    timeout: float = HANG_GUARD_S,
    started: asyncio.Event | None = None,
) -> Result:
    res = Result()
    async for resp in stub.Generate(req, timeout=timeout):
        res.request_id = resp.request_id
        res.token_ids += resp.token_ids
        if started is not None:
            started.set()
        res.finish_reason = resp.finish_reason or res.finish_reason
    return res


async def start_blocker(stub: pb_grpc.GenerationStub, rid: str) -> asyncio.Task[Result]:
    """A request that occupies the executor's only seat for hundreds of steps; returns once it runs."""
    req = greedy(list(range(100, 140)), 400, ignore_eos=True)
    req.request_id = rid
    started = asyncio.Event()
    task = asyncio.create_task(collect(stub, req, started=started))
    await asyncio.wait_for(started.wait(), HANG_GUARD_S)
    return task


def named(req: pb.GenerateRequest, rid: str, queue_timeout: float | None = None) -> pb.GenerateRequest:
    req.request_id = rid
    if queue_timeout is not None:
        req.queue_timeout = queue_timeout
    return req


def run(cluster: Cluster, body) -> object:  # type: ignore[no-untyped-def]
    async def go() -> object:
        async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            return await body(pb_grpc.GenerationStub(ch))

    return asyncio.run(go())


def test_over_max_pending_requests_is_refused_with_a_retry_hint(
    cluster: Cluster, rclient: redis.Redis, tiny_llama: Path
) -> None:
    keys = Keys(NS)

    async def body(stub: pb_grpc.GenerationStub) -> tuple[list[Result], grpc.aio.AioRpcError, Result]:
        blocker = await start_blocker(stub, "blocker-admission")
        accepted = [asyncio.create_task(collect(stub, greedy(p, 12))) for p in PROMPTS[:MAX_PENDING]]
        await until(lambda: rclient.zcard(keys.queue) == MAX_PENDING, "the accepted requests are queued")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub, greedy(PROMPTS[MAX_PENDING], 12))
        assert rclient.zcard(keys.queue) == MAX_PENDING, "a refused request leaves nothing behind"
        await stub.Abort(pb.AbortRequest(request_id="blocker-admission"))
        results = list(await asyncio.gather(*accepted))
        later = await collect(stub, greedy(PROMPTS[MAX_PENDING], 12))  # room again: accepted
        assert later.finish_reason in ("stop", "length")
        return results, refused.value, await blocker

    results, refused, blocker = run(cluster, body)  # type: ignore[misc]
    assert refused.code() == Code.RESOURCE_EXHAUSTED
    assert "--max-pending-requests" in refused.details() and "retry after" in refused.details()
    hint = dict(refused.trailing_metadata() or ())["retry-after"]
    assert hint.isdigit() and int(hint) >= 1
    assert blocker.finish_reason == "abort"
    expected = hf_greedy(tiny_llama, PROMPTS[:MAX_PENDING], [12] * MAX_PENDING)
    assert [r.token_ids for r in results] == expected, "accepted requests are token-identical to transformers"
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def _finished_record(rclient: redis.Redis, rid: str) -> dict[str, str]:
    keys = Keys(NS)
    fields = rclient.hgetall(keys.req(rid))
    assert fields["status"] == "finished"
    assert not rclient.sismember(keys.live, rid) and rclient.zscore(keys.attached, rid) is None
    assert not any(m.endswith(":" + rid) for m in rclient.zrange(keys.queue, 0, -1))
    assert rclient.ttl(keys.req(rid)) > 0, "only its finished record is left, and it expires"
    return fields


def test_expired_queue_deadline_ends_deadline_exceeded_and_frees_everything(
    cluster: Cluster, rclient: redis.Redis
) -> None:
    async def body(stub: pb_grpc.GenerationStub) -> tuple[grpc.aio.AioRpcError, ...]:
        blocker = await start_blocker(stub, "blocker-deadline")
        late = named(greedy(PROMPTS[0], 8), "late-queue", queue_timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError) as queue_timeout:
            await collect(stub, late)
        with pytest.raises(grpc.aio.AioRpcError) as resumed:
            async for _ in stub.Resume(pb.ResumeRequest(request_id="late-queue"), timeout=HANG_GUARD_S):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as call_deadline:
            await collect(stub, named(greedy(PROMPTS[1], 8), "late-call"), timeout=0.3)
        # a generous queue_timeout does not cut a request that starts in time
        patient = named(greedy(PROMPTS[2], 8), "patient", queue_timeout=3600)
        waiting = asyncio.create_task(collect(stub, patient))
        await until(lambda: rclient.zcard(Keys(NS).queue) == 1, "the patient request is queued")
        await stub.Abort(pb.AbortRequest(request_id="blocker-deadline"))
        assert (await waiting).finish_reason in ("stop", "length")
        await blocker
        return queue_timeout.value, resumed.value, call_deadline.value

    queue_timeout, resumed, call_deadline = run(cluster, body)  # type: ignore[misc]
    assert queue_timeout.code() == Code.DEADLINE_EXCEEDED and "queue_timeout" in queue_timeout.details()
    assert resumed.code() == Code.DEADLINE_EXCEEDED
    assert call_deadline.code() == Code.DEADLINE_EXCEEDED
    free, totals = wait_all_free(rclient, NS)
    assert free == totals, "every block is free again"
    assert _finished_record(rclient, "late-queue")["finish_reason"] == "deadline"
    assert _finished_record(rclient, "late-call")["finish_reason"] in ("deadline", "abort")
    assert rclient.llen(Keys(NS).out("late-queue")) == 0


S = pb.SamplingParams
CAPS = [
    ("three stop strings", pb.GenerateRequest(prompt="hi", sampling=S(stop=["a", "b", "c"])), "sampling.stop"),
    ("long stop string", pb.GenerateRequest(prompt="hi", sampling=S(stop=["ok", "x" * 9])), "sampling.stop[1]"),
    ("prompt over the byte cap", pb.GenerateRequest(prompt="é" * 129), "prompt"),
    (
        "messages over the byte cap",
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="m" * 200), pb.ChatMessage(role="user", content="m" * 60)]
        ),
        "messages",
    ),
    ("request over the byte cap", pb.GenerateRequest(prompt_token_ids=[30000] * 3000), "request"),
    ("queue_timeout 0", pb.GenerateRequest(prompt="hi", queue_timeout=0.0), "queue_timeout"),
    ("negative queue_timeout", pb.GenerateRequest(prompt="hi", queue_timeout=-1.0), "queue_timeout"),
    ("NaN queue_timeout", pb.GenerateRequest(prompt="hi", queue_timeout=float("nan")), "queue_timeout"),
    ("infinite queue_timeout", pb.GenerateRequest(prompt="hi", queue_timeout=float("inf")), "queue_timeout"),
]


@pytest.mark.parametrize("req,field", [c[1:] for c in CAPS], ids=[c[0] for c in CAPS])
def test_caps_are_invalid_argument_naming_the_field(cluster: Cluster, req: pb.GenerateRequest, field: str) -> None:
    with grpc.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationStub(ch).Generate(req, timeout=HANG_GUARD_S))
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":"), info.value.details()


def test_random_bytes_are_invalid_argument_and_the_server_still_serves(
    cluster: Cluster, tiny_llama: Path, rclient: redis.Redis
) -> None:
    rng = random.Random(13)
    payloads = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 96))) for _ in range(200)]
    methods = {"Generate": "unary_stream", "Resume": "unary_stream", "Abort": "unary_unary"}
    codes: dict[str, list[Code]] = {m: [] for m in methods}

    async def body(stub: pb_grpc.GenerationStub) -> Result:
        async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            for i, payload in enumerate(payloads):
                method = list(methods)[i % 3] if i >= 100 else "Generate"
                call_type = getattr(ch, methods[method])
                rpc = call_type(
                    f"/pagedserve.v1.Generation/{method}", request_serializer=None, response_deserializer=None
                )
                try:
                    got = rpc(payload, timeout=HANG_GUARD_S)
                    if methods[method] == "unary_stream":
                        async for _ in got:
                            pass
                    else:
                        await got
                    codes[method].append(Code.OK)
                except grpc.aio.AioRpcError as exc:
                    codes[method].append(exc.code())
        return await collect(stub, greedy(PROMPTS[3], 10))

    after = run(cluster, body)
    seen = {c for cs in codes.values() for c in cs}
    assert Code.UNKNOWN not in seen and Code.INTERNAL not in seen, codes
    assert seen == {Code.INVALID_ARGUMENT}, codes
    assert sum(len(c) for c in codes.values()) == 200
    assert after.token_ids == hf_greedy(tiny_llama, [PROMPTS[3]], [10])[0], "the server still serves, exactly"
    free, totals = wait_all_free(rclient, NS)
    assert free == totals


def test_executor_service_parses_in_the_handler() -> None:
    """``executor_svc.server.add_to_server``: bytes that are no plan get INVALID_ARGUMENT, a
    well-formed request reaches the servicer (a stand-in here: no model needed)."""

    class Servicer:
        async def Info(self, request: xpb.InfoRequest, context: grpc.aio.ServicerContext) -> xpb.InfoResponse:
            return xpb.InfoResponse(instance_id="seen", applied_seq=int(request.renew_instance))

        async def Step(self, request: xpb.StepPlan, context: grpc.aio.ServicerContext) -> xpb.StepResult:
            return xpb.StepResult(step_id=request.step_id)

        async def Steps(self, requests, context):  # type: ignore[no-untyped-def]
            async for plan in requests:
                yield xpb.StepResult(step_id=plan.step_id)

        async def ReadBlocks(self, request, context):  # type: ignore[no-untyped-def]
            yield xpb.BlockChunk(first=0, count=len(request.blocks))

    rng = random.Random(7)
    junk = [
        b"\xff",
        b"\x0a\xff\xff\xff\xff",
        b"\x08\x80",
        b"\x12\x05ab",
        *(b"\x0b" + rng.randbytes(20) for _ in range(8)),
    ]

    async def go() -> tuple[list[Code], xpb.InfoResponse, xpb.StepResult, list[xpb.BlockChunk]]:
        server = grpc.aio.server()
        add_executor_service(Servicer(), server)  # type: ignore[arg-type]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                for i, payload in enumerate(junk):
                    rpc = ch.unary_unary(
                        f"/pagedserve.executor.v1.Executor/{('Info', 'Step')[i % 2]}",
                        request_serializer=None,
                        response_deserializer=None,
                    )
                    try:
                        await rpc(payload, timeout=HANG_GUARD_S)
                        codes.append(Code.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                steps = ch.stream_stream(
                    "/pagedserve.executor.v1.Executor/Steps",
                    request_serializer=None,
                    response_deserializer=xpb.StepResult.FromString,
                )
                call = steps(iter([xpb.StepPlan(step_id=40).SerializeToString(), junk[0]]), timeout=HANG_GUARD_S)
                try:  # the stream's plans are parsed one by one: a good one answers, a bad one ends it
                    async for res in call:
                        codes.append(Code.OK if res.step_id == 40 else Code.UNKNOWN)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
                reads = ch.unary_stream(
                    "/pagedserve.executor.v1.Executor/ReadBlocks",
                    request_serializer=None,
                    response_deserializer=None,
                )
                try:  # a server stream: the junk request is refused before the handler runs
                    async for _ in reads(junk[0], timeout=HANG_GUARD_S):
                        pass
                    codes.append(Code.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
                stub = xpb_grpc.ExecutorStub(ch)
                info = await stub.Info(xpb.InfoRequest(renew_instance=True), timeout=HANG_GUARD_S)
                step = await stub.Step(xpb.StepPlan(step_id=41), timeout=HANG_GUARD_S)
                blocks = [xpb.BlockRef(tier=0, block=b) for b in (3, 4)]
                read = [c async for c in stub.ReadBlocks(xpb.ReadBlocksRequest(blocks=blocks), timeout=HANG_GUARD_S)]
        finally:
            await server.stop(None)
        return codes, info, step, read

    codes, info, step, read = asyncio.run(go())
    assert set(codes[:-3]) == {Code.INVALID_ARGUMENT}, codes
    assert codes[-3:-1] == [Code.OK, Code.INVALID_ARGUMENT], "Steps: the good plan answered, the junk refused"
    assert codes[-1] == Code.INVALID_ARGUMENT, "ReadBlocks: the junk refused"
    assert (info.instance_id, info.applied_seq, step.step_id) == ("seen", 1, 41)
    assert [(c.first, c.count) for c in read] == [(0, 2)], "a well-formed read reaches the servicer"


def test_store_admission_and_expiry_scripts(redis_url: str) -> None:
    """The submit script's limit and the expire script, on a namespace of their own."""

    async def go() -> None:
        client = aioredis.from_url(redis_url, decode_responses=True)
        store = RedisStore(client, "admission-scripts")
        k = store.keys
        try:

            def req(rid: str, deadline: int) -> Request:
                return Request(rid, [5, 6, 7], Params(max_tokens=4), deadline_ms=deadline)

            first = await store.admit(req("past", now_ms() - 1), [], "fcfs", max_pending=2)
            assert (first.queued, first.finished) == (1, 0)
            await store.admit(req("future", now_ms() + 3_600_000), [], "fcfs", max_pending=2)
            with pytest.raises(Overloaded) as over:
                await store.admit(req("third", 0), [], "fcfs", max_pending=2)
            assert over.value.seen.queued == 2 and not await client.exists(k.req("third"))
            assert (await store.admit(req("exempt", 0), [], "fcfs")).queued == 3, "no limit: accepted"
            assert await store.expire("past") == Expiry.EXPIRED
            assert await store.expire("past") == Expiry.NEVER, "finished: nothing more to do"
            assert await store.expire("future") == Expiry.LATER
            assert await store.expire("exempt") == Expiry.NEVER, "no deadline"
            assert await store.expire("unknown") == Expiry.NEVER
            fields = await client.hgetall(k.req("past"))
            assert (fields["status"], fields["finish_reason"]) == ("finished", "deadline")
            assert not await client.sismember(k.live, "past") and await client.zscore(k.attached, "past") is None
            assert await client.zcard(k.queue) == 2
            assert int(await client.hget(k.counters, "finished")) == 1
            await client.hset(k.req("future"), "dl", now_ms() - 1)
            await client.hset(k.req("future"), "executor", "x1")  # claimed: its loop expires it
            assert await store.expire("future") == Expiry.LATER
            await client.hset(k.req("future"), "executor", "")
            await client.rpush(k.out("future"), 9)  # it produced a token: started
            assert await store.expire("future") == Expiry.NEVER
        finally:
            await client.aclose()

    asyncio.run(go())
