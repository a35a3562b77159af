"""KV that moves between executors, on real stacks: tiny-Llama executors registered in a real
redis-server, a scheduler, gRPC over sockets.

- A drain: SIGTERM on the busier executor while its requests decode; its loop pre-copies their full
  blocks to the peer (which pulls them into its prefix cache while they keep decoding), then makes one
  short stop each (the rest lent, the peer pulls it) and decoding continues there from the next token.
- Failures mid-copy (a slow ``--read-blocks-delay-ms`` source): SIGKILL of the source, of the reader, and
  Redis SIGKILL with an AOF restart.
- ``--rebalance``: an executor joins, idle, and takes running requests with their KV.
- A peer prefix hit: a request placed on the idle executor pulls its prefix from the busy one's cache.

Greedy output stays token-identical to transformers throughout; seeded sampled, regex-constrained and
penalized requests give the same tokens as on a run without any move; the counters say what moved and
how; afterwards no block is lent, fetched, owned twice or leaked, and no loop died on the way.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import pytest
import redis

from pagedserve.keys import Keys
from pagedserve.v1 import generation_pb2 as pb
from tests.conftest import make_cluster
from tests.helpers import (
    aof_redis,
    counters,
    executors,
    finish,
    greedy,
    loop_failures,
    redis_outage,
    run_all,
    usage,
    wait_all_free,
)
from tests.test_e2e_oracle import hf_greedy
from tests.test_failover import run_in_background
from tests.test_scale_out import busiest, placed, wait_for

rng = random.Random(23)
N = 6
PROMPTS = [[rng.randrange(3, 49152) for _ in range(rng.randrange(120, 220))] for _ in range(N)]
MAX_TOKENS = [rng.randrange(220, 280) for _ in range(N)]  # prompt + output stays under the model's 512
FAST = ["--lease-ms", "3000"]
POOL = 512  # blocks per executor: either one holds every request, so every move finds room


def sampled(i: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=PROMPTS[i],
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.9, top_p=0.95, seed=40 + i),
    )


def penalized(i: int) -> pb.GenerateRequest:
    """Greedy under penalties over the prompt and the output so far: the destination rebuilds the histories."""
    return pb.GenerateRequest(
        prompt_token_ids=PROMPTS[i],
        sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS[i],
            temperature=0.0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
        ),
    )


def constrained(i: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=PROMPTS[i],
        sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS[i],
            temperature=0.8,
            seed=70 + i,
            structured_output=pb.StructuredOutput(regex="[a-z ]{40,200}"),
        ),
    )


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


def test_a_drain_moves_running_requests_with_their_kv(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "migrate-drain"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    others = [sampled(0), sampled(1), constrained(2), constrained(3), penalized(4)]
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=POOL,
        executors=2,
        executor_args=[*FAST, "--drain-timeout", "60"],
        scheduler_args=FAST,
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 2, what="two loops")
        unmoved = [r.token_ids for r in run_all(cluster.address, others)]
        before = counters(client, ns)

        worker, results = run_in_background(
            cluster.address, [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)] + others
        )
        wait_for(lambda: sum(placed(client, ns).values()) == N + len(others), what="every request placed")
        wait_for(
            lambda: counters(client, ns)["generated_tokens"] - before["generated_tokens"] > 10 * len(others),
            what="decoding under way",
        )
        victim, draining = busiest(cluster, client, ns)
        moving = placed(client, ns)[draining]
        assert moving > 0
        victim.proc.send_signal(signal.SIGTERM)
        assert victim.proc.wait(timeout=60) == 0, "a drained executor exits 0"
        free, totals = finish(worker, client, ns)
        after = counters(client, ns)
        keys = Keys(ns)
        assert not any(client.exists(k) for k in keys.executor(draining).all()), "nothing of it is left"

    assert [r.token_ids for r in results[:N]] == expected, "greedy: transformers' tokens through the move"
    assert [r.token_ids for r in results[N:]] == unmoved, "seeded, constrained, penalized: the tokens as unmoved"
    moved = after.get("migrations_out", 0) - before.get("migrations_out", 0)
    assert moved >= 1, "requests left the draining executor with their KV"
    assert after.get("migrations_in", 0) - before.get("migrations_in", 0) == moved, "each one's KV was pulled"
    assert after.get("migrations_failed", 0) == before.get("migrations_failed", 0) == 0
    assert after.get("migrated_bytes", 0) > 0
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("migrations_drain", 0) == moved, "by cause: all of them left for the drain"
    assert delta.get("precopy_blocks", 0) > 0, "full blocks were pre-copied while their requests kept decoding"
    assert delta.get("fetches_failed", 0) == 0
    assert free == totals, "every block of the surviving pool is free: none lent, none leaked"
    assert loop_failures(tmp_path) == []


def test_a_source_and_a_destination_killed_mid_move_lose_nothing(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    """SIGTERM starts the move; as soon as the source has lent its requests' KV it is SIGKILLed (its
    lends die with it: pulls still to come fail and recompute), and so is the busiest destination
    (its requests go back to the queue, their KV named on a dead source: recomputed). The third
    executor finishes every request with transformers' tokens; no block is left held."""
    ns = "migrate-kill"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=POOL,
        executors=3,
        executor_args=[*FAST, "--drain-timeout", "60"],
        scheduler_args=FAST,
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 3, what="three loops")
        before = counters(client, ns)
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])
        wait_for(lambda: sum(placed(client, ns).values()) == N, what="every request placed")
        source, source_id = busiest(cluster, client, ns)
        source.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: counters(client, ns).get("migrations_out", 0) > before.get("migrations_out", 0),
            what="the source to lend its requests' KV",
        )
        source.proc.send_signal(signal.SIGKILL)
        counts = {e: n for e, n in placed(client, ns).items() if e != source_id}
        dest_id = max(counts, key=counts.get)
        address = client.hget(Keys(ns).member(dest_id), "address")
        (dest,) = [s for s in cluster.executors if s.address == address]
        dest.proc.send_signal(signal.SIGKILL)
        worker.join(240)
        assert not worker.is_alive()
        wait_for(lambda: len(executors(client, ns)) == 1, what="the dead executors to be reaped")
        free, totals = wait_all_free(client, ns)
    assert [r.token_ids for r in results] == expected, "no token lost, duplicated or changed"
    assert free == totals, "the survivor's pool is all free"


@pytest.fixture(scope="module")
def long_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 4,096-position context (the same weights; its rotary embedding does not depend
    on the limit): requests long enough to outlast an executor's start."""
    dst = tmp_path_factory.mktemp("long-llama")
    for f in tiny_llama.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    return dst


LONG_PROMPTS = [[rng.randrange(3, 49152) for _ in range(rng.randrange(60, 120))] for _ in range(4)]
LONG_TOKENS = [rng.randrange(1400, 1800) for _ in LONG_PROMPTS]


def test_a_joined_executor_takes_running_requests_by_rebalance(
    long_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    """``--rebalance``: every request runs on the one executor there is, long enough to outlast the start of a
    second one, which joins idle. The first's KV usage soon exceeds the newcomer's by more than the gap, so its
    loop moves running requests there with their KV (pre-copied, then one short stop each) until half the gap
    is left. Greedy output stays transformers'; nothing is recomputed; no block is left held."""
    expected = hf_greedy(long_llama, LONG_PROMPTS, LONG_TOKENS)
    ns = "migrate-rebalance"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    balance = ["--rebalance", "--rebalance-gap", "0.2", "--rebalance-every-ms", "100"]
    with make_cluster(
        long_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=512,  # the four requests end at about 60% of it
        executor_args=FAST,
        scheduler_args=[*FAST, *balance],
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 1, what="one loop")
        before = counters(client, ns)
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(LONG_PROMPTS, LONG_TOKENS)])
        wait_for(lambda: sum(placed(client, ns).values()) == len(LONG_PROMPTS), what="every request placed")
        cluster.add_executor(FAST)
        free, totals = finish(worker, client, ns)
        after = counters(client, ns)

    assert [r.token_ids for r in results] == expected, "greedy: transformers' tokens through the moves"
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("migrations_rebalance", 0) >= 1, delta
    assert delta.get("migrations_in", 0) == delta["migrations_out"], "each one's KV was pulled"
    assert delta.get("moved_recomputed_tokens", 0) == 0 and delta.get("preemptions_recompute", 0) == 0
    assert free == totals
    assert loop_failures(tmp_path) == []


PREFIX = [rng.randrange(3, 49152) for _ in range(256)]  # 16 full blocks


def load(client: redis.Redis, ns: str, executor: str) -> float:
    """Device KV usage (0-1) of a pool, as its loop last published it (evictable cached blocks are free)."""
    v = usage(client, ns, executor)
    return 1 - v["free"][0] / v["blocks"][0]


def test_a_request_pulls_its_prefix_from_a_busier_peer(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    """A prompt's 256-token prefix is cached on one executor, which then gets busy (a long request on the
    same prefix holds over a quarter of its pool). The next request with that prefix goes to the idle
    executor (prefix-aware placement lets load win past the bound); its loop asks the busy one for the
    cached blocks, pulls them and computes only the rest of the prompt. Its greedy output is
    transformers'; the counters say the prefix came from the peer."""
    ns = "migrate-prefix"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    warm, filler, probe = (PREFIX + [rng.randrange(3, 49152) for _ in range(n)] for n in (5, 9, 13))
    (want,) = hf_greedy(tiny_llama, [probe], [24])
    with make_cluster(
        tiny_llama, redis_url, ns, tmp_path, blocks=64, executors=2, executor_args=FAST, scheduler_args=FAST
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 2, what="two loops")
        run_all(cluster.address, [greedy(warm, 1)])
        cached_on = {e for e in executors(client, ns) if client.scard(Keys(ns).executor(e).hashes) >= 16}
        assert len(cached_on) == 1, "the prefix is cached on one executor"
        (holder,) = cached_on
        worker, _ = run_in_background(cluster.address, [greedy(filler, 240, ignore_eos=True)])
        wait_for(lambda: load(client, ns, holder) > 0.3, what="the holder to get busy")
        before = counters(client, ns)
        (got,) = run_all(cluster.address, [greedy(probe, 24)])
        after = counters(client, ns)
        free, totals = finish(worker, client, ns)
    assert got.token_ids == want, "greedy: transformers' tokens with a pulled prefix"
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("peer_prefix_asks", 0) == 1 and delta.get("prefix_blocks", 0) == 16, delta
    assert delta.get("prefix_cache_hits", 0) >= 256, "the pulled blocks were its prefix hit"
    assert free == totals
    assert loop_failures(tmp_path) == []


SLOW = ["--read-blocks-delay-ms", "250"]  # every executor serves one block a chunk, a chunk every 250 ms


def fetching(client: redis.Redis, ns: str) -> list[str]:
    """Executors with a fetch in flight or held (its blocks named in their ``lent`` hash)."""
    return [
        e for e in executors(client, ns) if any(k.startswith("fetch/") for k in client.hkeys(Keys(ns).executor(e).lent))
    ]


@pytest.mark.parametrize("victim", ["source", "reader"])
def test_a_party_killed_mid_copy_loses_nothing(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]], victim: str
) -> None:
    """SIGTERM drains the busiest executor; its requests' full blocks are being pre-copied to a peer
    (slowly: ``--read-blocks-delay-ms``) when the source, or the reader, is SIGKILLed mid-copy. A dead
    source: the reader's pull fails, the source's requests are reaped and recomputed elsewhere. A dead
    reader: the source ends the pre-copy once the reader leaves the views and moves the requests to the
    third executor. Either way every request ends with transformers' tokens and no block stays held."""
    ns = f"migrate-mid-{victim}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=POOL,
        executors=3,
        executor_args=[*FAST, *SLOW, "--drain-timeout", "60"],
        scheduler_args=FAST,
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 3, what="three loops")
        before = counters(client, ns)
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])
        wait_for(lambda: sum(placed(client, ns).values()) == N, what="every request placed")
        source, source_id = busiest(cluster, client, ns)
        source.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: fetching(client, ns), what="a pre-copy under way")
        (reader_id,) = fetching(client, ns)[:1]
        if victim == "source":
            source.proc.send_signal(signal.SIGKILL)
        else:
            address = client.hget(Keys(ns).member(reader_id), "address")
            (reader,) = [s for s in cluster.executors if s.address == address]
            reader.proc.send_signal(signal.SIGKILL)
        free, totals = finish(worker, client, ns)
        after = counters(client, ns)
    assert [r.token_ids for r in results] == expected, "no token lost, duplicated or changed"
    assert free == totals, "the survivors' pools are all free"
    assert after.get("precopies", 0) > before.get("precopies", 0)
    assert loop_failures(tmp_path) == []


def test_redis_killed_mid_copy_restarts_from_its_aof(
    tiny_llama: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    """The same drain with a slow pre-copy, on a Redis of its own with an AOF (``appendfsync always``):
    SIGKILL mid-copy, restart from the AOF on the same port. Loops retry until it is back; the fenced
    commits and the lends' and fetches' records in Redis bring every pool back to a consistent state.
    Every request ends with transformers' tokens; no block stays held."""
    ns = "migrate-mid-redis"
    with (
        aof_redis() as (server, client),
        make_cluster(
            tiny_llama,
            server.url,
            ns,
            tmp_path,
            blocks=POOL,
            executors=2,
            executor_args=[*FAST, *SLOW, "--drain-timeout", "60"],
            scheduler_args=FAST,
        ) as cluster,
    ):
        wait_for(lambda: len(executors(client, ns)) == 2, what="two loops")
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)])
        wait_for(lambda: sum(placed(client, ns).values()) == N, what="every request placed")
        source, _ = busiest(cluster, client, ns)
        source.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: fetching(client, ns), what="a pre-copy under way")
        redis_outage(server)
        free, totals = finish(worker, client, ns)
        assert source.proc.wait(timeout=90) == 0, "the drained executor exits 0"
        log = Path(source.log_path).read_text()
        assert "drain deadline reached" not in log, "it exited once it owned nothing, not at its deadline"
    assert [r.token_ids for r in results] == expected, "no token lost, duplicated or changed"
    assert free == totals
    assert loop_failures(tmp_path) == []
