"""The pipelined loop (--async-scheduling, the default) on a real deployment: real Redis, the
tiny Llama, gRPC over sockets. The loop plans step N+1 before step N's tokens are known and
finds finishes one step late; the token a finished sequence gets in that extra step must never
be streamed or stored, an abort with two plans in flight must free every block, and a loop
killed with two plans in flight must lose and duplicate nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import redis

from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2_grpc as gen_grpc
from tests.conftest import make_cluster
from tests.helpers import collect, executors, greedy, kill_loop, run_all, wait_all_free
from tests.test_e2e_oracle import hf_greedy
from tests.test_failover import run_in_background, wait_progress
from tests.test_preemption import PROMPTS


def steps(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def stored(client: redis.Redis, ns: str, request_id: str) -> list[int]:
    return [int(t) for t in client.lrange(Keys(ns).out(request_id), 0, -1)]


def test_late_finishes_never_stream_or_store_the_extra_token(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    """Length and stop-token finishes are found a step late, while the next plan (which ran the
    finished sequence once more) is already at the executor: its extra token is dropped."""
    prompts, max_tokens = PROMPTS[:6], [5, 9, 16, 1, 12, 7]
    expected = hf_greedy(tiny_llama, prompts, max_tokens)
    ns = "pipe-late"
    log = tmp_path / "steps.jsonl"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama, redis_url, ns, tmp_path, blocks=64, scheduler_args=["--step-log", str(log)]
    ) as cluster:
        by_length = run_all(cluster.address, [greedy(p, n) for p, n in zip(prompts, max_tokens)])
        # A stop token that greedy decoding reaches mid-way: the request ends on it, nothing after.
        stops = [exp[len(exp) // 2] for exp in expected]
        by_stop = run_all(
            cluster.address, [greedy(p, n, stop_token_ids=[s]) for p, n, s in zip(prompts, max_tokens, stops)]
        )
        free, totals = wait_all_free(client, ns)
        for res, exp, n in zip(by_length, expected, max_tokens):
            assert res.token_ids == exp and len(res.token_ids) == n == res.completion_tokens
            assert res.finish_reason == "length"
            assert stored(client, ns, res.request_id) == res.token_ids
        for res, exp, s in zip(by_stop, expected, stops):
            assert res.token_ids == exp[: exp.index(s) + 1]
            assert res.finish_reason == "stop"
            assert stored(client, ns, res.request_id) == res.token_ids
    assert free == totals
    rows = steps(log)
    assert any(r["in_flight"] >= 1 for r in rows), "the loop had the next plan at the executor"
    assert all(r["rtt_ms"] > 0 for r in rows)


def test_abort_with_two_plans_in_flight_frees_every_block(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    """Clients go away mid-generation: each request is aborted while it is in the plan the
    executor runs and in the one queued behind it; every block comes back, nothing more is stored."""
    ns = "pipe-abort"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(ns)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64) as cluster:

        async def go() -> None:
            async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
                stub = gen_grpc.GenerationStub(ch)
                tasks = [asyncio.create_task(collect(stub, greedy(p, 400))) for p in PROMPTS[:6]]
                while sum(client.llen(keys.out(rid)) for rid in client.smembers(keys.live)) < 30:
                    await asyncio.sleep(0.02)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(go())
        free, totals = wait_all_free(client, ns)
        assert free == totals
        assert client.scard(keys.live) == 0
        for rid in client.keys(keys.out("*")):
            assert client.llen(rid) < 400, "aborted requests stop generating"
        (again,) = run_all(cluster.address, [greedy(PROMPTS[0], 10)])
        assert again.token_ids == hf_greedy(tiny_llama, [PROMPTS[0]], [10])[0]


def test_loop_killed_with_two_plans_in_flight_loses_and_duplicates_nothing(
    tiny_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    """SIGKILL the scheduler's loop while it has two plans at the executor (the stream dies with
    it: the executor drops the queued plan); a new loop reloads the last commit and continues.
    Streams resume from the stored tokens: every completion equals greedy, token for token."""
    prompts, max_tokens = PROMPTS[:6], [50, 64, 40, 70, 55, 45]
    expected = hf_greedy(tiny_llama, prompts, max_tokens)
    ns = "pipe-kill"
    log = tmp_path / "steps.jsonl"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=64,
        scheduler_args=["--lease-ms", "1500", "--step-log", str(log)],
    ) as cluster:
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(prompts, max_tokens)])
        wait_progress(client, ns, 40)
        kill_loop(client, ns, cluster.scheduler.proc.pid)
        worker.join(120)
        free, totals = wait_all_free(client, ns)
        assert len(executors(client, ns)) == 1
        for res, exp in zip(results, expected):
            assert res.token_ids == exp
            assert stored(client, ns, res.request_id) == exp
    assert free == totals
    assert any(r["in_flight"] >= 1 for r in steps(log))
