"""Automatic prefix caching on real deployments (tiny Llama, real Redis, gRPC and executor pools).

Greedy outputs stay token-identical to transformers for requests sharing 0, 1,
several blocks and a partial block with earlier ones, while small pools evict
cached blocks and preempt (swap and recompute) and with caching off; a shared
system prompt is computed once (the counters and ``cached_tokens`` say how
many tokens were reused) and holds fewer blocks; different ``cache_salt``s
share nothing; with two executors a request follows its cached prefix.
"""

from __future__ import annotations

import asyncio
import random
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
from tests.helpers import greedy, run_all, until, wait_all_free
from tests.test_e2e_oracle import hf_greedy

rng = random.Random(11)
SHARED = [rng.randrange(3, 49152) for _ in range(40)]  # 2 full blocks + 8 tokens


def _tail(n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


# Prefixes shared with SHARED (sent first): 0 blocks, 1 block, several blocks, a partial block,
# all of it (a whole-prompt hit still computes its last token), and more than all of it.
PROMPTS = [
    SHARED,
    _tail(30),
    SHARED[:16] + _tail(20),
    SHARED[:32] + _tail(9),
    SHARED[:20] + _tail(15),
    list(SHARED),
    SHARED + _tail(25),
    SHARED[:33] + _tail(3),
]
MAX_TOKENS = [24, 30, 40, 28, 36, 24, 32, 40]
SYSTEM = [rng.randrange(3, 49152) for _ in range(128)]  # 8 blocks
QUESTIONS = [SYSTEM + _tail(rng.randrange(4, 12)) for _ in range(8)]


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


async def _stream(address: str, reqs: list[pb.GenerateRequest]) -> list[list[pb.GenerateResponse]]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(r: pb.GenerateRequest) -> list[pb.GenerateResponse]:
            return [m async for m in stub.Generate(r, timeout=300)]

        return await asyncio.gather(*(one(r) for r in reqs))


def final(address: str, req: pb.GenerateRequest) -> pb.GenerateResponse:
    """The last message of one request, sent alone."""
    return asyncio.run(_stream(address, [req]))[0][-1]


# Each mode: the scheduler's flags and the CPU swap tier in blocks (None: the executor's default).
MODES = {
    "swap": (["--preemption-mode", "swap"], 64),
    "recompute": (["--preemption-mode", "recompute"], None),
    "off": (["--no-enable-prefix-caching"], None),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_identical_with_shared_prefixes_under_eviction_and_preemption(
    mode: str, tiny_llama: Path, expected: list[list[int]], redis_url: str, tmp_path: Path
) -> None:
    sargs, swap_blocks = MODES[mode]
    ns = f"prefix-{mode}"
    # 10 blocks: the burst cannot all fit, so cached blocks are evicted and requests preempted.
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=10,
        swap_blocks=swap_blocks,
        scheduler_args=[*sargs, "--max-num-batched-tokens", "48"],
    ) as cluster:
        first = final(cluster.address, greedy(PROMPTS[0], MAX_TOKENS[0]))  # SHARED is cached from here on
        results = run_all(cluster.address, [greedy(p, n) for p, n in zip(PROMPTS[1:], MAX_TOKENS[1:])])
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        free, totals = wait_all_free(client, ns)
        seen = helpers.counters(client, ns)
    assert first.finish_reason and first.cached_tokens == 0
    for res, exp, prompt in zip(results, expected[1:], PROMPTS[1:]):
        assert res.token_ids == exp, f"prompt of {len(prompt)} tokens diverged ({mode})"
    assert free == totals, "blocks leaked (cached blocks count as free: nobody holds them)"
    if mode == "off":
        assert seen.get("prefix_cache_queries", 0) == 0 and seen.get("prefix_cache_hits", 0) == 0
    else:
        assert seen["prefix_cache_hits"] > 0, seen
        assert seen.get(f"preemptions_{mode}", 0) > 0, f"the pool was meant to be too small: {seen}"


def _tables_while_running(
    address: str, client: redis.Redis, ns: str, reqs: list[pb.GenerateRequest]
) -> list[list[int]]:
    """The device block tables of ``reqs`` once they all run at once (they are long; aborted after),
    read in one transaction: one step's commit, consistent across requests."""
    keys = Keys(ns)

    def tables() -> list[list[int]]:
        pipe = client.pipeline(transaction=True)
        for r in reqs:
            pipe.hmget(keys.req(r.request_id), "status", "blocks")
        rows = pipe.execute()
        if any(status != "running" for status, _ in rows):
            return []
        return [[int(b) for b in blocks.split(",") if b] for _, blocks in rows]

    async def go() -> list[list[int]]:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            calls = [stub.Generate(r, timeout=300) for r in reqs]
            tasks = [asyncio.ensure_future(_drain(c)) for c in calls]
            got: list[list[list[int]]] = []
            await until(lambda: bool(got.append(tables()) or got[-1]), "all running at once")
            for r in reqs:
                await stub.Abort(pb.AbortRequest(request_id=r.request_id))
            await asyncio.gather(*tasks)
            return got[-1]

    return asyncio.run(go())


async def _drain(call) -> None:  # noqa: ANN001
    async for _ in call:
        pass


@pytest.mark.parametrize("caching", [True, False])
def test_a_shared_system_prompt_is_computed_once_and_held_once(
    caching: bool, tiny_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    ns = f"prefix-system-{caching}"
    flag = [] if caching else ["--no-enable-prefix-caching"]
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=256, scheduler_args=flag) as cluster:
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        warm = final(cluster.address, greedy(SYSTEM + [5, 6, 7], 4))
        before = helpers.counters(client, ns)
        long = [greedy(q, 300, ignore_eos=True) for q in QUESTIONS]
        for i, r in enumerate(long):
            r.request_id = f"{ns}-q{i}"
        tables = _tables_while_running(cluster.address, client, ns, long)
        wait_all_free(client, ns)
        short = run_all(cluster.address, [greedy(q, 4) for q in QUESTIONS])
        after = helpers.counters(client, ns)
        # Salts: the same prompt under another salt shares nothing; under the same salt it hits.
        salted = [
            final(
                cluster.address,
                pb.GenerateRequest(
                    prompt_token_ids=SYSTEM + [9, 9],
                    cache_salt=s,
                    sampling=pb.SamplingParams(max_tokens=2, temperature=0),
                ),
            )
            for s in ("tenant-a", "tenant-b", "tenant-a", "")
        ]
    assert warm.cached_tokens == 0
    hits = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
    held = len({b for t in tables for b in t})
    system_blocks = len(SYSTEM) // 16
    if caching:
        assert hits == 2 * len(QUESTIONS) * len(SYSTEM), "each question reused the whole system prompt, twice"
        assert all(t[:system_blocks] == tables[0][:system_blocks] for t in tables), "one copy of the system prompt"
        assert held == sum(len(t) for t in tables) - (len(tables) - 1) * system_blocks
        assert [salted[i].cached_tokens for i in range(4)] == [0, 0, len(SYSTEM), len(SYSTEM)]
    else:
        assert hits == 0 and all(s.cached_tokens == 0 for s in salted)
        assert held == sum(len(t) for t in tables), "every request holds its own copy"
    assert all(r.finish_reason == "length" for r in short)


def test_a_request_follows_its_cached_prefix_to_the_executor_holding_it(
    tiny_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    ns = "prefix-placement"
    keys = Keys(ns)
    # 256 blocks each: the busy request (at most 34 blocks) keeps its executor within the load bound.
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=256, executors=2) as cluster:
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        asyncio.run(until(lambda: len(helpers.executors(client, ns)) == 2, "both executors publish"))

        def place(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> pb.GenerateRequest:
            r = greedy(prompt, max_tokens, **kw)
            r.request_id = rid
            return r

        final(cluster.address, place("a", SYSTEM + [11]))
        holder = client.hget(keys.req("a"), "executor")

        async def busy_then_follow() -> pb.GenerateResponse:
            async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
                stub = pb_grpc.GenerationStub(ch)
                # A long request keeps the holder busy; the other executor idles: without the prefix rule
                # the next request would go there.
                busy = asyncio.ensure_future(
                    _drain(stub.Generate(place("busy", SYSTEM + [12], 400, ignore_eos=True), timeout=300))
                )
                await until(lambda: client.hget(keys.req("busy"), "status") == "running", "busy runs")
                last = [m async for m in stub.Generate(place("b", SYSTEM + [13]), timeout=300)][-1]
                await stub.Abort(pb.AbortRequest(request_id="busy"))
                await busy
                return last

        b = asyncio.run(busy_then_follow())
        assert client.hget(keys.req("busy"), "executor") == holder
        assert client.hget(keys.req("b"), "executor") == holder, "the second request went where its prefix is"
        assert b.cached_tokens == len(SYSTEM)
