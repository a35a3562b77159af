"""Client-side helpers for tests: concurrent streams and Redis pool checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import redis

from pagedserve.dev.procs import RedisServer
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.tiers import TIERS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

GIB = 1 << 30


def block_bytes(model_dir: Path | str, block_size: int = 16, dtype_bytes: int = 4) -> int:
    """Bytes of one KV-cache block of the model in ``model_dir``, from its ``config.json``: K and V, for every layer,
    ``block_size`` tokens of ``num_key_value_heads`` heads of ``head_dim`` values of ``dtype_bytes`` each (fp32, the
    executor's default dtype). Pool and swap sizes in the tests are counts of these, never literal byte counts."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * block_size * kv_heads * head_dim * dtype_bytes


@dataclass(slots=True)
class Result:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    request_id: str = ""
    chunks: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> Result:
    res = Result()
    async for resp in stub.Generate(req, timeout=300):
        res.request_id = resp.request_id
        res.token_ids += resp.token_ids
        res.texts.append(resp.text)
        res.chunks += 1
        if resp.finish_reason:
            res.finish_reason = resp.finish_reason
            res.prompt_tokens, res.completion_tokens = resp.prompt_tokens, resp.completion_tokens
    return res


def run_all(address: str, reqs: list[pb.GenerateRequest]) -> list[Result]:
    """Send every request at once on one channel; results in request order."""

    async def go() -> list[Result]:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            return await asyncio.gather(*(collect(stub, r) for r in reqs))

    return asyncio.run(go())


async def group_responses(
    stub: pb_grpc.GenerationStub, req: pb.GenerateRequest
) -> dict[int, list[pb.GenerateResponse]]:
    """Responses of one Generate call by completion index (a request with ``n`` > 1 streams them interleaved)."""
    by_index: dict[int, list[pb.GenerateResponse]] = {}
    async for m in stub.Generate(req, timeout=300):
        by_index.setdefault(m.index, []).append(m)
    return by_index


def offset_tokens(msgs: list[pb.GenerateResponse]) -> list[int]:
    """One completion's tokens, checking that each response's offset counts that completion's own tokens."""
    out: list[int] = []
    for m in msgs:
        assert m.offset == len(out), "offsets count the completion's own tokens"
        out += m.token_ids
    return out


def run_groups(address: str, reqs: list[pb.GenerateRequest]) -> list[dict[int, list[pb.GenerateResponse]]]:
    """``run_all`` for requests with ``n``: per request, its responses by completion index."""

    async def go() -> list[dict[int, list[pb.GenerateResponse]]]:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            return await asyncio.gather(*(group_responses(stub, r) for r in reqs))

    return asyncio.run(go())


def greedy(ids: list[int], max_tokens: int, **kw: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    )


def executors(client: redis.Redis, namespace: str) -> list[str]:
    """Instance ids of the executors whose pools the loops publish."""
    return sorted(client.hkeys(Keys(namespace).usage))


def pool_state(client: redis.Redis, namespace: str, executor: str) -> tuple[list[int], list[int]]:
    """(free, total) block counts per tier of one executor's pool, as its free bitmaps in Redis say."""
    x = Keys(namespace).executor(executor)
    totals = [int(n) for n in client.hget(x.pool, "blocks").split(",")]
    return [client.bitcount(x.free(t)) for t in TIERS], totals


def usage(client: redis.Redis, namespace: str, executor: str) -> dict:
    """The view of one pool its loop last published."""
    return json.loads(client.hget(Keys(namespace).usage, executor))


def counters(client: redis.Redis, namespace: str) -> dict[str, int]:
    """Namespace totals: preemptions, swapped blocks, steps."""
    return {k: int(v) for k, v in client.hgetall(Keys(namespace).counters).items()}


def wait_all_free(client: redis.Redis, namespace: str, timeout: float = 30) -> tuple[list[int], list[int]]:
    """Poll until no request is live and every pool is free; returns (free, total) summed over executors."""
    keys = Keys(namespace)
    deadline = time.monotonic() + timeout
    while True:
        states = [pool_state(client, namespace, e) for e in executors(client, namespace)]
        free = [sum(f[t] for f, _ in states) for t in TIERS]
        totals = [sum(n[t] for _, n in states) for t in TIERS]
        if (states and free == totals and client.scard(keys.live) == 0) or time.monotonic() > deadline:
            return free, totals
        time.sleep(0.1)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll ``predicate`` every 20 ms; AssertionError naming ``what`` after ``timeout`` s
    (a guard against a hang, not a timing check)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


def kill_loop(client: redis.Redis, namespace: str, scheduler_pid: int) -> tuple[str, int]:
    """SIGKILL a scheduler replica's loop process (its one child) mid-run, leading the namespace's
    one executor; returns that executor's epoch key and its epoch before, for a test to check that
    a new loop took the lease."""
    (executor,) = executors(client, namespace)
    key = Keys(namespace).executor(executor).epoch
    epoch = int(client.get(key))
    (loop_proc,) = psutil.Process(scheduler_pid).children()
    os.kill(loop_proc.pid, signal.SIGKILL)
    return key, epoch


def loop_failures(log_dir: Path) -> list[str]:
    """Lines where a scheduler's loop died of an error (the manager restarts it, and a reload hides the
    failure from every client): a test of a loop's path asserts there are none."""
    return [
        line
        for log in sorted(Path(log_dir).glob("scheduler*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "ERROR loop for executor" in line
    ]


def finish(worker: threading.Thread, client: redis.Redis, namespace: str, join_s: float = 240) -> tuple[list, list]:
    """Wait for a background client (``tests.test_failover.run_in_background``) to have every answer, then
    for every pool to be free; returns (free, total) blocks per tier, summed over the executors."""
    worker.join(join_s)
    assert not worker.is_alive(), f"requests still unanswered after {join_s:.0f} s"
    return wait_all_free(client, namespace, timeout=60)


@contextlib.contextmanager
def aof_redis() -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A redis-server of the test's own that writes its AOF on every write (``appendfsync always``), and a client
    on it: for tests that SIGKILL Redis mid-run and restart it from the AOF (``redis_outage``)."""
    server = RedisServer(appendfsync="always")
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        yield server, client
    finally:
        client.close()
        server.stop()


def redis_outage(server: RedisServer, down_s: float = 1.0) -> None:
    """SIGKILL the Redis server, then restart it on its port and directory (from its AOF, if it has one)."""
    server.kill()
    time.sleep(down_s)
    server.restart()
