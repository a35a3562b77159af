"""Failures mid-generation on a real deployment lose no request and change no token:
the scheduling loop killed with SIGKILL (a new one takes the executor's lease and
continues from Redis), and the executor killed and restarted on the same address
(its KV is gone: it comes back as a new instance, the old one's requests go back to
the queue and are recomputed on the new one)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import redis

from pagedserve.keys import Keys
from tests.conftest import make_cluster
from tests.helpers import executors, greedy, kill_loop, run_all, wait_all_free
from tests.test_e2e_oracle import hf_greedy
from tests.test_preemption import PROMPTS

MAX_TOKENS = [60, 45, 70, 50]


def generated(client: redis.Redis, ns: str) -> int:
    keys = Keys(ns)
    return sum(client.llen(keys.out(rid)) for rid in client.smembers(keys.live))


def wait_progress(client: redis.Redis, ns: str, tokens: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while generated(client, ns) < tokens:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def run_in_background(address: str, reqs: list) -> tuple[threading.Thread, list]:
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(run_all(address, reqs)))
    worker.start()
    return worker, results


def test_killed_loop_is_replaced_and_requests_complete(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    prompts = PROMPTS[:4]
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    ns = "failover-loop"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64, scheduler_args=["--lease-ms", "1500"]) as cluster:
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(prompts, MAX_TOKENS)])
        wait_progress(client, ns, 20)
        epoch_key, epoch = kill_loop(client, ns, cluster.scheduler.proc.pid)
        worker.join(120)
        assert int(client.get(epoch_key)) > epoch, "a new loop took the lease"
        free, totals = wait_all_free(client, ns)
    assert [r.token_ids for r in results] == expected
    assert free == totals


def test_executor_restart_recomputes_live_requests(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    prompts = PROMPTS[4:8]
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    ns = "failover-executor"
    keys = Keys(ns)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64) as cluster:
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(prompts, MAX_TOKENS)])
        wait_progress(client, ns, 20)
        (old,) = executors(client, ns)
        port = int(cluster.executor.address.rsplit(":", 1)[1])
        cluster.executor.proc.kill()
        cluster.executor.proc.wait()
        cluster.executors.pop(0)
        cluster.add_executor(port=port)
        worker.join(120)
        assert client.zscore(keys.evicted, old) is not None, "the old instance was evicted"
        assert not any(client.exists(k) for k in keys.executor(old).all()), "its pool state is gone"
        (new,) = executors(client, ns)
        assert new != old
        free, totals = wait_all_free(client, ns)
    assert [r.token_ids for r in results] == expected
    assert free == totals


def test_a_hung_executor_times_out_and_comes_back_as_a_new_instance(
    tiny_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    """SIGSTOP: its Step exceeds --executor-timeout, its requests finish elsewhere; SIGCONT: it
    finds itself evicted and rejoins with a new instance id and empty tables."""
    prompts, max_tokens = PROMPTS[:8], [40] * 8
    expected = hf_greedy(tiny_llama, prompts, max_tokens)
    ns = "failover-hung"
    keys = Keys(ns)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    fast = ["--lease-ms", "3000"]
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=16,
        executors=2,
        executor_args=fast,
        scheduler_args=[*fast, "--executor-timeout", "2"],
    ) as cluster:
        wait_progress(client, ns, 0)
        worker, results = run_in_background(cluster.address, [greedy(p, n) for p, n in zip(prompts, max_tokens)])
        wait_progress(client, ns, 10)
        placed = {e: client.scard(keys.executor(e).live) for e in executors(client, ns)}
        hung = max(placed, key=placed.get)
        address = client.hget(keys.member(hung), "address")
        (svc,) = [s for s in cluster.executors if s.address == address]
        svc.proc.send_signal(signal.SIGSTOP)
        worker.join(120)
        assert [r.token_ids for r in results] == expected
        assert client.zscore(keys.evicted, hung) is not None
        svc.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while not [e for e in executors(client, ns) if e != hung and client.hget(keys.member(e), "address") == address]:
            assert time.monotonic() < deadline, "the executor did not rejoin"
            time.sleep(0.1)
        (again,) = run_all(cluster.address, [greedy(prompts[0], 40)])
        assert again.token_ids == expected[0]
