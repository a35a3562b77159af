"""Failures mid-generation on a real deployment lose no request and change no token:
the scheduling loop killed with SIGKILL (a new one takes the lease and continues
from Redis), and the executor restarted (its KV is gone; the loop notices the new
instance and recomputes every live request)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import redis

from pagedserve.procs import Service
from tests.conftest import make_cluster
from tests.helpers import greedy, run_all, wait_all_free
from tests.test_e2e_oracle import hf_greedy
from tests.test_preemption import BLOCK_BYTES, PROMPTS

MAX_TOKENS = [60, 45, 70, 50]


def _generated(client: redis.Redis, ns: str) -> int:
    return sum(client.llen("{" + ns + "}:out:" + rid) for rid in client.smembers("{" + ns + "}:live"))


def _wait_progress(client: redis.Redis, ns: str, tokens: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _generated(client, ns) < tokens:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def _run_in_background(address: str, reqs: list) -> tuple[threading.Thread, list]:
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(run_all(address, reqs)))
    worker.start()
    return worker, results


def test_killed_loop_is_replaced_and_requests_complete(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    prompts = PROMPTS[:4]
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    ns = "failover-loop"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, kv_cache_memory=64 * BLOCK_BYTES,
                      scheduler_args=["--lease-ms", "1500"]) as cluster:
        worker, results = _run_in_background(cluster.address, [greedy(p, n) for p, n in zip(prompts, MAX_TOKENS)])
        _wait_progress(client, ns, 20)
        epoch = int(client.get("{" + ns + "}:epoch"))
        (loop_proc,) = psutil.Process(cluster.scheduler.proc.pid).children()
        os.kill(loop_proc.pid, signal.SIGKILL)
        worker.join(120)
        assert int(client.get("{" + ns + "}:epoch")) > epoch, "a new loop took the lease"
        free, totals = wait_all_free(client, ns)
    assert [r.token_ids for r in results] == expected
    assert free == totals


def test_executor_restart_recomputes_live_requests(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    prompts = PROMPTS[4:8]
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    ns = "failover-executor"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, kv_cache_memory=64 * BLOCK_BYTES) as cluster:
        worker, results = _run_in_background(cluster.address, [greedy(p, n) for p, n in zip(prompts, MAX_TOKENS)])
        _wait_progress(client, ns, 20)
        old = client.hget("{" + ns + "}:meta", "instance_id")
        port = int(cluster.executor.address.rsplit(":", 1)[1])
        cluster.executor.proc.kill()
        cluster.executor.proc.wait()
        cluster.executor = Service("executor_svc", ["--model", str(tiny_llama), "--kv-cache-memory",
                                                    str(64 * BLOCK_BYTES)], port, tmp_path / "executor2.log")
        worker.join(120)
        assert client.hget("{" + ns + "}:meta", "instance_id") != old, "the state was rebound to the new executor"
        free, totals = wait_all_free(client, ns)
    assert [r.token_ids for r in results] == expected
    assert free == totals
