"""Many executors behind one API, on real processes (tiny Llama executors registered
through --redis-url/--advertise-address, scheduler replicas started without
--executor, a real redis-server, gRPC over sockets).

Greedy outputs stay token-identical to transformers while executors serve in
parallel, die (SIGKILL), join mid-run, drain on SIGTERM, and while a scheduler
replica dies; Redis is left with every surviving pool free and nothing of the
executors that left.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
import redis

from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import Service, grpc_healthy
from pagedserve.keys import Keys
from tests.conftest import make_cluster
from tests.helpers import executors, greedy, pool_state, wait_all_free
from tests.test_e2e_oracle import hf_greedy
from tests.test_failover import run_in_background

rng = random.Random(8)
PROMPTS = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 48))] for _ in range(24)]
MAX_TOKENS = [rng.randrange(30, 90) for _ in range(24)]
REQS = [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
# Long generations on small pools (one or two at a time each): the queue is still deep when an
# executor started mid-run has loaded its model and joined.
LONG_MAX = [rng.randrange(150, 200) for _ in range(24)]
LONG = [greedy(p, n) for p, n in zip(PROMPTS, LONG_MAX)]
SMALL_POOL = 16  # blocks
# Each executor holds ~5 of these requests at once: the rest queue, so work spreads and moves.
POOL = 32  # blocks
FAST = ["--lease-ms", "3000"]


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def expected_long(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, LONG_MAX)


def split(cluster: Cluster, reqs: list) -> tuple[list, list]:
    """Half of the requests through each scheduler replica, in the background."""
    half = len(reqs) // 2
    return (
        run_in_background(cluster.schedulers[0].address, reqs[:half]),
        run_in_background(cluster.schedulers[1].address, reqs[half:]),
    )


def join(*runs: tuple) -> list:
    out = []
    for worker, results in runs:
        worker.join(180)
        assert not worker.is_alive(), "requests did not complete"
        out += results
    return out


def placed(client: redis.Redis, ns: str) -> dict[str, int]:
    """Requests placed on each executor right now."""
    keys = Keys(ns)
    return {e: client.scard(keys.executor(e).live) for e in executors(client, ns)}


def wait_for(check, timeout: float = 60, what: str = "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def busiest(cluster: Cluster, client: redis.Redis, ns: str) -> tuple[Service, str]:
    """The executor process holding the most requests, and its instance id."""
    counts = placed(client, ns)
    eid = max(counts, key=counts.get)
    address = client.hget(Keys(ns).member(eid), "address")
    (svc,) = [s for s in cluster.executors if s.address == address]
    return svc, eid


def served_by(client: redis.Redis, ns: str, request_ids: list[str]) -> set[str]:
    return {client.hget(Keys(ns).req(rid), "executor") for rid in request_ids}


def test_three_executors_serve_in_parallel_and_survive_a_sigkill(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "scale-three"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama, redis_url, ns, tmp_path, blocks=POOL, executors=3, executor_args=FAST, scheduler_args=FAST
    ) as cluster:
        cluster.start_scheduler(FAST)
        wait_for(lambda: len(executors(client, ns)) == 3, what="three loops")
        results = join(*split(cluster, REQS))
        assert [r.token_ids for r in results] == expected
        assert served_by(client, ns, [r.request_id for r in results]) == set(executors(client, ns)), (
            "every executor served some"
        )

        # Again, and one executor dies mid-run. Two of them holding work is what that needs: a loop that a replica
        # hands to another (their share of 3 is 2 and 1) places nothing for the second or so it moves, and a
        # clean-clone run timed out waiting for all three at once (the hand-off was logged just before).
        runs = split(cluster, REQS)
        wait_for(lambda: sorted(placed(client, ns).values())[-2] > 0, what="work on two executors")
        victim, dead = busiest(cluster, client, ns)
        victim.proc.send_signal(signal.SIGKILL)
        results = join(*runs)
        assert [r.token_ids for r in results] == expected, "no gap, no duplicate, same tokens after the loss"
        wait_for(lambda: dead not in executors(client, ns), what="the dead executor's view to go")
        free, totals = wait_all_free(client, ns)
        assert free == totals and totals[0] == 2 * 32, "both surviving pools are fully free"
        keys = Keys(ns)
        assert client.zscore(keys.evicted, dead) is not None
        assert not any(client.exists(k) for k in keys.executor(dead).all()), "the dead one's state is gone"
        assert not client.zscore(keys.members, dead)


def test_an_executor_joins_mid_run_and_another_drains(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected_long: list[list[int]]
) -> None:
    ns = "scale-join-drain"
    drain_s = 6
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=SMALL_POOL,
        executors=2,
        executor_args=[*FAST, "--drain-timeout", str(drain_s)],
        scheduler_args=FAST,
    ) as cluster:
        wait_for(lambda: len(executors(client, ns)) == 2, what="two loops")
        worker, results = run_in_background(cluster.address, LONG)
        wait_for(lambda: client.zcard(Keys(ns).queue) > 0, what="a queue")
        before = set(executors(client, ns))
        cluster.add_executor()
        assert client.zcard(Keys(ns).queue) > 0, "work still waits when the new executor is up"
        wait_for(
            lambda: any(n > 0 for e, n in placed(client, ns).items() if e not in before),
            what="the new executor to receive work",
        )

        victim, draining = busiest(cluster, client, ns)
        assert placed(client, ns)[draining] > 0
        victim.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not grpc_healthy(victim.address), what="NOT_SERVING while it drains")
        assert victim.proc.poll() is None, "still draining: its requests are still placed there"
        assert client.hget(Keys(ns).member(draining), "state") == "draining"
        assert victim.proc.wait(timeout=drain_s + 20) == 0, "a drained executor exits 0"
        assert client.hget(Keys(ns).member(draining), "address") is None, "it deleted its membership record"
        worker.join(180)
        assert [r.token_ids for r in results] == expected_long
        free, totals = wait_all_free(client, ns)
        assert free == totals


def test_a_dead_replicas_loops_move_to_the_other(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "scale-replica"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(ns)
    with make_cluster(
        tiny_llama, redis_url, ns, tmp_path, blocks=POOL, executors=2, executor_args=FAST, scheduler_args=FAST
    ) as cluster:
        survivor = cluster.start_scheduler(FAST)
        leaders = lambda: {e: client.get(keys.executor(e).leader) for e in executors(client, ns)}  # noqa: E731
        wait_for(lambda: len(set(leaders().values()) - {None}) == 2, what="one loop per replica")
        worker, results = run_in_background(survivor.address, REQS)
        wait_for(lambda: sum(placed(client, ns).values()) > 4, what="work under way")
        doomed = cluster.schedulers[0]
        (loop_proc,) = psutil.Process(doomed.proc.pid).children()
        led_by_doomed = [e for e, r in leaders().items() if r and r.split("-")[-2] == str(loop_proc.pid)]
        assert led_by_doomed, "the doomed replica leads an executor"
        epochs = {e: int(client.get(keys.executor(e).epoch)) for e in led_by_doomed}
        os.kill(loop_proc.pid, signal.SIGKILL)
        doomed.proc.send_signal(signal.SIGKILL)
        worker.join(180)
        assert [r.token_ids for r in results] == expected
        for e, epoch in epochs.items():
            assert int(client.get(keys.executor(e).epoch)) > epoch, "the other replica took the lease"
            assert pool_state(client, ns, e)[0][0] == 32
