"""Parallel sampling (``sampling.n``) on real deployments (tiny Llama, real Redis, gRPC, executor pools).

n greedy completions are n copies of transformers' greedy output, under preemption (swap and
recompute) too; seeded completions are reproducible and differ from each other; while a group
runs its completions hold the prompt's full blocks once (each has its own copy of the partial
one); Abort and Resume take the request's id; ``n`` above ``--max-n`` is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from pathlib import Path

import grpc
import pytest
import redis

from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests import helpers
from tests.conftest import make_cluster
from tests.helpers import greedy, group_responses, kill_loop, offset_tokens, run_groups, until, wait_all_free
from tests.test_e2e_oracle import hf_greedy

rng = random.Random(23)
PROMPT = [rng.randrange(3, 49152) for _ in range(40)]  # 2 full blocks + 8 tokens
OTHER = [rng.randrange(3, 49152) for _ in range(25)]


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, [PROMPT, OTHER, PROMPT], [48, 40, 120])


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    with make_cluster(
        tiny_llama,
        redis_url,
        "parallel",
        tmp_path_factory.mktemp("parallel"),
        blocks=64,
        scheduler_args=["--max-n", "8"],
    ) as c:
        yield c


def test_n_greedy_completions_are_transformers_greedy_and_end_each_with_its_own_message(
    cluster, expected: list[list[int]]
) -> None:  # noqa: ANN001
    req = greedy(PROMPT, 48, n=4)
    req.request_id = "greedy4"
    (got,) = run_groups(cluster.address, [req])
    assert sorted(got) == [0, 1, 2, 3]
    for msgs in got.values():
        assert all(m.request_id == "greedy4" for m in msgs)
        assert offset_tokens(msgs) == expected[0]
        assert [bool(m.finish_reason) for m in msgs][-1] and not any(m.finish_reason for m in msgs[:-1])
        assert (msgs[-1].prompt_tokens, msgs[-1].completion_tokens) == (len(PROMPT), 48)


def test_seeded_completions_are_reproducible_and_differ(cluster) -> None:  # noqa: ANN001
    def sampled() -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=pb.SamplingParams(max_tokens=24, temperature=1.0, seed=1234, n=4, ignore_eos=True),
        )

    first, second = run_groups(cluster.address, [sampled(), sampled()])
    runs = [{i: offset_tokens(m) for i, m in r.items()} for r in (first, second)]
    assert runs[0] == runs[1], "seed + index makes every completion reproducible"
    assert len({tuple(t) for t in runs[0].values()}) == 4, "each completion samples with its own seed"


def test_the_group_holds_its_prompt_blocks_once(cluster, redis_url: str) -> None:  # noqa: ANN001
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys("parallel")
    before = helpers.counters(client, "parallel").get("forked_tokens", 0)

    def tables() -> list[list[int]]:
        pipe = client.pipeline(transaction=True)
        for i in range(4):
            pipe.hmget(keys.req(f"held#{i}"), "status", "blocks")
        rows = pipe.execute()
        if any(status != "running" or not blocks for status, blocks in rows):
            return []
        return [[int(b) for b in blocks.split(",")] for _, blocks in rows]

    async def go() -> tuple[list[list[int]], bool, dict[int, list[pb.GenerateResponse]]]:
        async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            req = greedy(PROMPT, 400, n=4, ignore_eos=True)
            req.request_id = "held"
            call = asyncio.ensure_future(group_responses(stub, req))
            seen: list[list[list[int]]] = []
            await until(lambda: bool(seen.append(tables()) or seen[-1]), "all four completions hold blocks")
            found = (await stub.Abort(pb.AbortRequest(request_id="held"))).found
            return seen[-1], found, await call

    held, found, got = asyncio.run(go())
    after = helpers.counters(client, "parallel").get("forked_tokens", 0)
    wait_all_free(client, "parallel")
    assert found, "Abort takes the request's id"
    assert all(t[:2] == held[0][:2] for t in held), "one copy of the prompt's two full blocks"
    assert len({t[2] for t in held}) == 4, "each completion has its own copy of the partial block"
    assert after - before == 3 * (len(PROMPT) - 1), "three completions forked from the one that computed the prompt"
    assert sorted(got) == [0, 1, 2, 3] and all(m[-1].finish_reason == "abort" for m in got.values())


def test_resume_takes_the_request_id_and_an_index(cluster) -> None:  # noqa: ANN001
    async def go() -> tuple[dict[int, list[int]], dict[int, list[int]], list[int], grpc.StatusCode]:
        async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            req = pb.GenerateRequest(
                request_id="resumed",
                prompt_token_ids=OTHER,
                sampling=pb.SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3),
            )
            whole = {i: offset_tokens(m) for i, m in (await group_responses(stub, req)).items()}
            resumed: dict[int, list[int]] = defaultdict(list)
            async for m in stub.Resume(pb.ResumeRequest(request_id="resumed", offset=5)):
                assert m.offset >= min(5, len(whole[m.index])) or not m.token_ids
                resumed[m.index] += m.token_ids
            one = [
                t
                async for m in stub.Resume(pb.ResumeRequest(request_id="resumed", offset=0, index=2))
                for t in m.token_ids
            ]
            try:
                async for _ in stub.Resume(pb.ResumeRequest(request_id="resumed", index=3)):
                    pass
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            return whole, dict(resumed), one, code

    whole, resumed, one, code = asyncio.run(go())
    assert resumed == {i: t[5:] for i, t in whole.items()}
    assert one == whole[2]
    assert code == grpc.StatusCode.OUT_OF_RANGE


@pytest.mark.parametrize("n", [0, 9])
def test_n_outside_one_to_max_n_is_invalid_argument(cluster, n: int) -> None:  # noqa: ANN001
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run_groups(cluster.address, [greedy(PROMPT, 4, n=n)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.n" in err.value.details()


def test_a_group_id_and_a_request_id_never_name_two_live_things(cluster) -> None:  # noqa: ANN001
    async def refused(
        stub: pb_grpc.GenerationStub, live: pb.GenerateRequest, clash: pb.GenerateRequest
    ) -> grpc.StatusCode:
        call = stub.Generate(live, timeout=300)
        await call.read()  # it runs
        try:
            async for _ in stub.Generate(clash, timeout=60):
                pass
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            call.cancel()

    def named(rid: str, n: int = 1) -> pb.GenerateRequest:
        r = greedy(PROMPT, 400, ignore_eos=True, n=n)
        r.request_id = rid
        return r

    async def go() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            return [
                await refused(stub, named("one"), named("one", 2)),
                await refused(stub, named("two", 2), named("two")),
            ]

    assert asyncio.run(go()) == [grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_groups_under_preemption_stay_transformers_greedy(
    mode: str, tiny_llama: Path, redis_url: str, expected: list[list[int]], tmp_path: Path
) -> None:
    ns = f"parallel-{mode}"
    # 12 blocks: a group of 3 (3 + 2 x 1 blocks to start, 4 each at the end) and two others cannot all fit.
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=12,
        swap_blocks=64 if mode == "swap" else None,
        scheduler_args=["--preemption-mode", mode, "--max-num-batched-tokens", "48"],
    ) as c:
        got = run_groups(c.address, [greedy(PROMPT, 48, n=3), greedy(OTHER, 40), greedy(PROMPT, 48, n=2)])
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        free, totals = wait_all_free(client, ns)
        seen = helpers.counters(client, ns)
    assert {i: offset_tokens(m) for i, m in got[0].items()} == {i: expected[0] for i in range(3)}
    assert offset_tokens(got[1][0]) == expected[1]
    assert {i: offset_tokens(m) for i, m in got[2].items()} == {i: expected[0] for i in range(2)}
    assert free == totals, "blocks leaked"
    assert seen.get("preemptions_recompute", 0) + seen.get("preemptions_swap", 0) > 0, seen
    assert seen.get("forked_tokens", 0) > 0, seen


def test_a_loop_killed_while_a_group_runs_loses_and_duplicates_nothing(
    tiny_llama: Path, redis_url: str, expected: list[list[int]], tmp_path: Path
) -> None:
    """SIGKILL the loop (pipelined, plans in flight) while a group decodes with its prompt shared: a
    new loop reloads the shared tables (relinking any mate still waiting to fork) and goes on."""
    ns = "parallel-kill"
    keys = Keys(ns)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64, scheduler_args=["--lease-ms", "1500"]) as c:

        async def go() -> dict[int, list[pb.GenerateResponse]]:
            async with grpc.aio.insecure_channel(c.address, options=CHANNEL_OPTIONS) as ch:
                req = greedy(PROMPT, 120, n=3)
                req.request_id = "killed"
                call = asyncio.ensure_future(group_responses(pb_grpc.GenerationStub(ch), req))
                await until(
                    lambda: all(client.llen(keys.out(f"killed#{i}")) >= 20 for i in range(3)),
                    "every completion is well under way",
                )
                kill_loop(client, ns, c.scheduler.proc.pid)
                return await call

        got = asyncio.run(go())
        free, totals = wait_all_free(client, ns)
        stored = {i: [int(t) for t in client.lrange(keys.out(f"killed#{i}"), 0, -1)] for i in range(3)}
    assert {i: offset_tokens(m) for i, m in got.items()} == {i: expected[2] for i in range(3)}
    assert stored == {i: expected[2] for i in range(3)}
    assert free == totals, "blocks leaked"
