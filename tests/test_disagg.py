"""Prefill and decode executors (``--role``), on real stacks: executors registered in a real redis-server,
a scheduler with ``--disagg-min-prompt-tokens``, gRPC over sockets.

A long prompt goes to the prefill executor, which computes it in chunks (``--max-num-batched-tokens``
below the prompt) and, after each reported chunk, offers the newly full blocks to a decode executor,
which reserves room for the whole prompt and pulls them while the rest is computed; after the first
token the prefill executor lends the rest and the decode executor pulls it and decodes. Short prompts
run on the decode executor, mixed. Greedy output is transformers' (tiny Llama and SmolLM2); seeded
sampled and constrained requests give the same tokens as without disaggregation; SIGKILL of the
prefill or the decode executor mid-transfer, and Redis SIGKILL with an AOF restart mid-transfer, lose
and duplicate nothing and leak no block.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from pagedserve.keys import Keys
from pagedserve.v1 import generation_pb2 as pb
from tests.conftest import make_cluster
from tests.helpers import aof_redis, executors, finish, greedy, loop_failures, redis_outage, run_all, wait_all_free
from tests.test_e2e_oracle import TEXTS, hf_greedy
from tests.test_failover import run_in_background
from tests.test_migration import FAST, SLOW, fetching
from tests.test_scale_out import placed, wait_for

rng = random.Random(26)
LONG = [[rng.randrange(3, 49152) for _ in range(rng.randrange(150, 260))] for _ in range(4)]
SHORT = [[rng.randrange(3, 49152) for _ in range(rng.randrange(10, 40))] for _ in range(2)]
MAX_TOKENS = [rng.randrange(40, 120) for _ in range(6)]
DISAGG = ["--disagg-min-prompt-tokens", "64", "--disagg-max-prefill-queue", "8", "--max-num-batched-tokens", "64"]


def roles(client: redis.Redis, ns: str) -> dict[str, str]:
    return {e: client.hget(Keys(ns).member(e), "role") or "mixed" for e in executors(client, ns)}


def by_role(client: redis.Redis, ns: str, role: str) -> list[str]:
    return [e for e, r in roles(client, ns).items() if r == role]


def executor_counters(client: redis.Redis, ns: str, executor: str) -> dict[str, int]:
    return {k: int(v) for k, v in client.hgetall(Keys(ns).executor(executor).counters).items()}


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, LONG + SHORT, MAX_TOKENS)


def seeded(prompt: list[int], seed: int, salt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        cache_salt=salt,
        sampling=pb.SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=seed),
    )


def constrained(prompt: list[int], seed: int, salt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        cache_salt=salt,
        sampling=pb.SamplingParams(
            max_tokens=60, temperature=0.8, seed=seed, structured_output=pb.StructuredOutput(regex="[a-z ]{20,60}")
        ),
    )


def test_long_prompts_are_prefilled_on_the_prefill_executor_and_decoded_on_the_decode_one(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "disagg"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    # Salted apart: the baseline's prompts, cached on the decode executor, must not make the split run's
    # prompts cached (then they would not split).
    others = lambda salt: [seeded(LONG[0], 5, salt), constrained(LONG[1], 6, salt)]  # noqa: E731
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=256,
        executor_args=[*FAST, "--role", "decode"],
        scheduler_args=[*FAST, *DISAGG],
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 1, what="the decode executor")
        alone = [r.token_ids for r in run_all(cluster.address, others("alone"))]  # no prefill executor: no split
        cluster.add_executor(["--role", "prefill"])
        wait_for(lambda: by_role(client, ns, "prefill"), what="the prefill executor")
        (prefill,), (decode,) = by_role(client, ns, "prefill"), by_role(client, ns, "decode")
        results = run_all(cluster.address, [greedy(p, n) for p, n in zip(LONG + SHORT, MAX_TOKENS)] + others("split"))
        p, d = executor_counters(client, ns, prefill), executor_counters(client, ns, decode)
        free, totals = wait_all_free(client, ns)
    assert [r.token_ids for r in results[:6]] == expected, "greedy: transformers' tokens"
    assert [r.token_ids for r in results[6:]] == alone, "seeded and constrained: the tokens as without a split"
    assert p.get("migrations_disagg", 0) == len(LONG) + 2, "every long prompt was handed over"
    assert d.get("handoff_blocks", 0) > 0, "blocks came while the prompts were computed"
    assert d.get("migrations_in", 0) == p["migrations_disagg"] and d.get("migrations_failed", 0) == 0
    assert p.get("generated_tokens", 0) <= 2 * p["migrations_disagg"], "the prefill executor only starts them"
    assert free == totals
    assert loop_failures(tmp_path) == []


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_an_executor_killed_mid_transfer_loses_nothing(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]], victim: str
) -> None:
    """The prefill executor serves its blocks slowly (``--read-blocks-delay-ms``); while a decode executor
    is pulling a prompt's blocks, the prefill or that decode executor gets SIGKILL. A dead prefill
    executor's requests go back to the queue and run mixed on a decode executor; a dead decode executor's
    handoffs go to the other one. Every request ends with transformers' tokens; no block stays held."""
    ns = f"disagg-kill-{victim}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=256,
        executors=2,
        executor_args=[*FAST, "--role", "decode", "--drain-timeout", "30"],
        scheduler_args=[*FAST, *DISAGG],
    ) as cluster:
        pre = cluster.add_executor(["--role", "prefill", *SLOW])
        wait_for(lambda: len(executors(client, ns)) == 3, what="three loops")
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(LONG + SHORT, MAX_TOKENS)])
        wait_for(lambda: fetching(client, ns), timeout=90, what="a handoff under way")
        if victim == "prefill":
            pre.proc.send_signal(signal.SIGKILL)
        else:
            (reader,) = fetching(client, ns)[:1]
            address = client.hget(Keys(ns).member(reader), "address")
            (dead,) = [s for s in cluster.executors if s.address == address]
            dead.proc.send_signal(signal.SIGKILL)
        free, totals = finish(worker, client, ns)
    assert [r.token_ids for r in results] == expected, "no token lost, duplicated or changed"
    assert free == totals
    assert loop_failures(tmp_path) == []


def test_redis_killed_mid_transfer_restarts_from_its_aof(
    tiny_llama: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "disagg-redis"
    with (
        aof_redis() as (server, client),
        make_cluster(
            tiny_llama,
            server.url,
            ns,
            tmp_path,
            blocks=256,
            executor_args=[*FAST, "--role", "decode"],
            scheduler_args=[*FAST, *DISAGG],
        ) as cluster,
    ):
        cluster.add_executor(["--role", "prefill", *SLOW])
        wait_for(lambda: len(executors(client, ns)) == 2, what="two loops")
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(LONG + SHORT, MAX_TOKENS)])
        wait_for(lambda: fetching(client, ns), timeout=90, what="a handoff under way")
        redis_outage(server)
        free, totals = finish(worker, client, ns)
        assert sum(placed(client, ns).values()) == 0
    assert [r.token_ids for r in results] == expected, "no token lost, duplicated or changed"
    assert free == totals
    assert loop_failures(tmp_path) == []


def test_smollm2_disaggregated_matches_transformers(smol_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """SmolLM2, one prefill and one decode executor: long text prompts are prefilled there and decoded here,
    short ones run mixed; every output is transformers' greedy one."""
    tok = AutoTokenizer.from_pretrained(smol_dir)
    story = " ".join(TEXTS) + " The end of one story is the start of another, and so it went on."
    prompts = [tok(story * 6).input_ids[:n] for n in (150, 220)] + [tok(TEXTS[0]).input_ids[:20]]
    max_tokens = [12] * len(prompts)
    want = hf_greedy(smol_dir, prompts, max_tokens)
    ns = "disagg-smol"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        smol_dir,
        redis_url,
        ns,
        tmp_path,
        kv_cache_memory=64 << 20,
        executor_args=[*FAST, "--role", "decode"],
        scheduler_args=[*FAST, *DISAGG],
    ) as cluster:
        cluster.add_executor(["--role", "prefill"])
        wait_for(lambda: len(executors(client, ns)) == 2, what="two loops")
        (prefill,) = by_role(client, ns, "prefill")
        results = run_all(cluster.address, [greedy(p, n) for p, n in zip(prompts, max_tokens)])
        handed = executor_counters(client, ns, prefill).get("migrations_disagg", 0)
        free, totals = wait_all_free(client, ns)
    assert [r.token_ids for r in results] == want, "greedy: transformers' tokens"
    assert handed == 2, "both long prompts were prefilled on the prefill executor and handed over"
    assert free == totals
