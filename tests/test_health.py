"""Health that tells the truth, and membership that refuses strangers (real processes).

A scheduler is SERVING only while it reaches Redis and some compatible executor
serves; liveness stays SERVING throughout. An executor of another block size
is refused with a clear log line and never gets work.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
import redis

from pagedserve.dev.procs import Service, free_port, grpc_healthy, wait_until
from pagedserve.keys import Keys
from pagedserve.rpc import LIVENESS
from tests.conftest import make_cluster
from tests.helpers import executors, greedy, run_all


def test_scheduler_health_follows_its_executors(tiny_llama: Path, redis_url: str, tmp_path: Path) -> None:
    ns = "health"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        executors=0,
        executor_args=["--lease-ms", "3000", "--drain-timeout", "5"],
        scheduler_args=["--lease-ms", "3000"],
    ) as cluster:
        sched = cluster.scheduler.address
        assert not grpc_healthy(sched) and grpc_healthy(sched, LIVENESS), "up, but nothing to serve with"
        with pytest.raises(grpc.RpcError) as info:
            run_all(sched, [greedy([5, 6, 7], 4)])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        good = cluster.add_executor()
        wait_until(lambda: grpc_healthy(sched), 30, "scheduler SERVING once an executor serves")
        stranger = cluster.add_executor(["--block-size", "32"])
        assert stranger.log_path is not None
        wait_until(lambda: "refused" in stranger.log_path.read_text(), 30, "the stranger to log its refusal")
        log = cluster.scheduler.log_path
        assert log is not None
        wait_until(lambda: "refused" in log.read_text(), 30, "the scheduler to log the refusal")
        (res,) = run_all(sched, [greedy([5, 6, 7], 4)])
        assert res.completion_tokens == 4
        stranger_id = next(
            e for e in client.zrange(Keys(ns).members, 0, -1) if client.hget(Keys(ns).member(e), "block_size") == "32"
        )
        assert stranger_id not in executors(client, ns), "no loop ever stepped the refused executor"

        good.proc.send_signal(signal.SIGTERM)
        assert good.proc.wait(timeout=30) == 0
        wait_until(lambda: not grpc_healthy(sched), 30, "scheduler NOT_SERVING with no compatible executor")
        assert grpc_healthy(sched, LIVENESS)


def test_scheduler_without_redis_is_not_serving_but_alive(tmp_path: Path) -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    svc = Service("scheduler_svc", ["--redis-url", dead_redis], free_port(), tmp_path / "scheduler.log", ready=LIVENESS)
    try:
        time.sleep(2)  # a few membership reads have failed by now
        assert not grpc_healthy(svc.address)
        assert grpc_healthy(svc.address, LIVENESS)
    finally:
        svc.stop()
