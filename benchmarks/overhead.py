"""Scheduler overhead: the real scheduler_svc + Redis driving the stub executor.

For each loop (serial: ``--no-async-scheduling``; pipelined: the default) and
each running target R a stub (``--step-ms``: a simulated forward pass, 20 ms by
default) and scheduler (``--max-num-seqs R``, its own Redis namespace) get R
long requests, then more until W wait behind them; requests never finish
during a window (long ``max_tokens``, ``ignore_eos``). Running levels with
none waiting are measured on the way up on one stub and scheduler; each level
with requests waiting gets its own (``chains``). From ``--step-log``:
the executor's wait between two steps (``idle_ms``, measured by the stub: from
the end of one step to the start of the next, the scheduler's critical path),
its duty cycle (time inside steps / (that + the waits)), and the loop's own
time per step (schedule_ms + redis_ms: on the critical path only when serial).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from benchmarks.arm_pagedserve import request_pb
from pagedserve.dev.procs import RedisServer, Service, free_port, start_all, stop_all
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
LONG_OUTPUT = 8192  # tokens; no request finishes within a measurement window
STREAMS_PER_CHANNEL = 1000


LOOPS = {"serial": ["--no-async-scheduling"], "pipelined": ["--async-scheduling"]}


@dataclass(slots=True)
class OverheadPoint:
    running: int
    waiting: int
    steps: int
    p50_ms: float  # the executor's wait between steps (the gap): the scheduler's critical path
    p99_ms: float
    mean_ms: float
    schedule_p50_ms: float  # the loop's own work per step
    redis_p50_ms: float
    rpc_p50_ms: float  # executor_ms: serial, the Step round trip; pipelined, the wait for the oldest result
    loop: str = "serial"
    step_ms: float = 0.0  # the stub's simulated step
    duty_cycle: float = 0.0  # time inside steps / (that + the gaps)
    plan_p50_ms: float = 0.0
    commit_p50_ms: float = 0.0
    encode_p50_ms: float = 0.0
    decode_p50_ms: float = 0.0


class StepTail:
    """Reads only the step-log lines appended since the last call (the log grows by thousands per second)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rows: list[dict[str, float]] = []

    def poll(self) -> list[dict[str, float]]:
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offset += end
            self.rows += [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        return self.rows


def _point(rows: list[dict[str, float]], running: int, waiting: int, loop: str, step_ms: float) -> OverheadPoint:
    gaps = [r["idle_ms"] for r in rows]
    busy = sum(r["step_ms"] for r in rows)
    med = lambda k: float(np.median([r.get(k, 0.0) for r in rows]))  # noqa: E731
    return OverheadPoint(
        running,
        waiting,
        len(rows),
        float(np.percentile(gaps, 50)),
        float(np.percentile(gaps, 99)),
        float(np.mean(gaps)),
        med("schedule_ms"),
        med("redis_ms"),
        med("executor_ms"),
        loop,
        step_ms,
        busy / (busy + sum(gaps)) if busy else 0.0,
        med("plan_ms"),
        med("commit_ms"),
        med("encode_ms"),
        med("decode_ms"),
    )


async def hold(stub: pb_grpc.GenerationStub, prompt: list[int], rid: str) -> None:
    """Read the first message (the request runs), then hold the stream open unread until cancelled.

    Reading every token (~12,800 messages/s at 256 running on a 20 ms step) would take this one asyncio
    client most of a core of the two the measured loop runs on; an unread stream costs it nothing while the
    frontend still streams every token (coalesced once the stream's flow-control window is full)."""
    call = stub.Generate(request_pb(prompt, LONG_OUTPUT, rid))
    try:
        await call.read()
        await asyncio.Event().wait()
    except (grpc.aio.AioRpcError, asyncio.CancelledError):
        pass
    finally:
        call.cancel()


def _reached(row: dict[str, float], running: int, waiting: int) -> bool:
    """At the target; 2% slack on waiting, as the rare finished request lets one more in."""
    return row["running"] == running and row["waiting"] >= waiting * 0.98


async def _wait_for(tail: StepTail, running: int, waiting: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = tail.poll()
        if rows and _reached(rows[-1], running, waiting):
            return True
        await asyncio.sleep(0.25)
    return False


Point = tuple[int, int]  # (running, waiting)


def chains(levels: list[tuple[int, list[int]]]) -> list[list[Point]]:
    """The points of ``levels`` (running levels, each with its waiting levels) grouped into chains of one deployment.

    The points with none waiting form one chain, filled request by request from one running level to the next on
    one stub and scheduler (``--max-num-seqs`` the largest). A level's points with requests waiting need
    ``--max-num-seqs`` equal to it and form a chain of their own on a fresh deployment, its running and first
    waiting requests sent at once: thousands of requests sent to a deployment already streaming tokens to dozens
    were seen to take over a minute to queue on 2 cores.
    """
    idle = [(running, 0) for running, waiting in sorted(levels) if 0 in waiting]
    queued = [[(running, w) for w in sorted(waiting) if w > 0] for running, waiting in sorted(levels)]
    return [c for c in (idle, *queued) if c]


async def _sweep_chain(
    dep: ChainDeployment,
    chain: list[Point],
    window_s: float,
    prompt: list[int],
    reach_s: float,
    loop: str,
    step_ms: float,
) -> list[OverheadPoint]:
    """The chain's points on ``dep``: requests meant to run go to its scheduler, those meant to wait to its intake."""
    points: list[OverheadPoint] = []
    tasks: list[asyncio.Task[None]] = []
    tail = StepTail(dep.step_log)
    # One HTTP/2 connection carries only so many concurrent streams (about 3000
    # were seen here): spread the thousands of requests over several connections.
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    top, deepest = max(r for r, _ in chain), max(w for _, w in chain)

    def channels(address: str, streams: int) -> list[grpc.aio.Channel]:
        return [grpc.aio.insecure_channel(address, options=options) for _ in range(-(-streams // STREAMS_PER_CHANNEL))]

    run_channels, wait_channels = channels(dep.address, top), channels(dep.intake_address, deepest)
    run_stubs = [pb_grpc.GenerationStub(ch) for ch in run_channels]
    wait_stubs = [pb_grpc.GenerationStub(ch) for ch in wait_channels]
    async with contextlib.AsyncExitStack() as stack:
        for ch in (*run_channels, *wait_channels):
            await stack.enter_async_context(ch)
        try:
            for running, waiting in chain:
                while len(tasks) < running + waiting:
                    i = len(tasks)
                    stub = (
                        run_stubs[i // STREAMS_PER_CHANNEL] if i < top else wait_stubs[(i - top) // STREAMS_PER_CHANNEL]
                    )
                    tasks.append(asyncio.create_task(hold(stub, prompt, f"ovh-{loop}-{chain[-1][0]}-{i}")))
                if not await _wait_for(tail, running, waiting, timeout=reach_s):
                    log.warning("scheduler never reached %d running / %d waiting; skipping", running, waiting)
                    break
                await asyncio.sleep(min(1.0, window_s / 2))  # let the intake burst pass
                start = time.time()
                await asyncio.sleep(window_s)
                rows = [r for r in tail.poll() if start <= r["t"] <= start + window_s and _reached(r, running, waiting)]
                if rows:
                    points.append(_point(rows, running, waiting, loop, step_ms))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return points


Grid = list[tuple[list[int], list[int], tuple[str, ...]]]  # (running levels, waiting levels, loops)


def sweep(
    model_dir: Path,
    grid: Grid,
    window_s: float,
    log_dir: Path,
    prompt_len: int = 8,
    reach_s: float = 90.0,
    step_ms: float = 20.0,
) -> list[OverheadPoint]:
    """Overhead points per loop and (running, waiting) point of ``grid``; a point not filled within ``reach_s`` is
    skipped with the rest of its chain. Chains run by running level, both loops side by side (their deployments
    started at once; each stopped once measured, the other idle meanwhile); points come back sorted by running,
    waiting and loop."""
    log_dir.mkdir(parents=True, exist_ok=True)
    prompt = list(range(100, 100 + prompt_len))
    order = list(LOOPS)
    runs = sorted(
        (
            (chain, loop)
            for loop in order
            for chain in chains([(r, waiting) for running, waiting, loops in grid if loop in loops for r in running])
        ),
        key=lambda c: (c[0][-1], order.index(c[1])),
    )
    redis = RedisServer()
    points: list[OverheadPoint] = []
    try:
        for _, group in itertools.groupby(runs, key=lambda c: c[0][-1][0]):
            group = list(group)
            deployments = start_all(
                [
                    functools.partial(
                        _deploy,
                        model_dir,
                        redis.url,
                        chain[-1][0],
                        loop,
                        log_dir,
                        len(prompt),
                        step_ms,
                        any(w for _, w in chain),
                    )
                    for chain, loop in group
                ]
            )
            try:
                for (chain, loop), dep in zip(group, deployments):
                    points += asyncio.run(_sweep_chain(dep, chain, window_s, prompt, reach_s, loop, step_ms))
                    # Its requests outlive their cancelled streams (resumable, until --detach-timeout) and would
                    # keep its loop, frontend and stub stepping through the next chain's window: stopped now.
                    dep.stop()
            finally:
                stop_all(deployments)
    finally:
        redis.stop()
    return sorted(points, key=lambda p: (p.running, p.waiting, order.index(p.loop)))


@dataclass(slots=True)
class ChainDeployment:
    stub: Service
    scheduler: Service  # role all: the loop, and the frontend of the running requests
    step_log: Path
    intake: Service | None = None  # role frontend: where requests meant to wait are sent

    @property
    def address(self) -> str:
        return self.scheduler.address

    @property
    def intake_address(self) -> str:
        return (self.intake or self.scheduler).address

    def stop(self) -> None:
        stop_all([s for s in (self.intake, self.scheduler, self.stub) if s is not None])


def _deploy(
    model_dir: Path,
    redis_url: str,
    running: int,
    loop: str,
    log_dir: Path,
    prompt_len: int,
    step_ms: float,
    intake: bool = False,
) -> ChainDeployment:
    """A fresh stub (its fencing epoch starts over) and a fresh scheduler and namespace for one chain of one loop,
    ``--max-num-seqs`` its last running level. The scheduler registers the stub itself (``--executor``): the stub
    is static, as in a fixed deployment.

    ``intake``: a second replica (``--role frontend``) takes the requests meant to wait. The replica streaming
    tokens to 256 running requests (~12,800 messages/s on a 20 ms step) was seen to accept new requests at
    ~20/s, and gRPC cancels calls the application has not taken within 30 s (the server's
    ``max_unrequested_time_in_server``): the queue stopped at 364-600 of 1,024. Spreading the API over replicas
    is what a deployment does; the loop measured is the same."""
    step_log = log_dir / f"steps-{loop}-r{running}.jsonl"
    step_log.unlink(missing_ok=True)
    stub = Service(
        "benchmarks.stub_executor",
        ["--model", str(model_dir), "--host", "127.0.0.1", "--step-ms", str(step_ms)],
        free_port(),
        log_dir / f"stub-{loop}-r{running}.log",
    )
    common = [
        "--redis-url",
        redis_url,
        "--executor",
        stub.address,
        "--namespace",
        f"ovh-{loop}-{running}",
        "--max-num-seqs",
        str(running),
        "--max-num-batched-tokens",
        str(max(2048, running * prompt_len)),
        "--log-level",
        "WARNING",
        *LOOPS[loop],
    ]

    def scheduler() -> Service:
        return Service(
            "scheduler_svc",
            [*common, "--step-log", str(step_log)],
            free_port(),
            log_dir / f"scheduler-{loop}-r{running}.log",
        )

    def frontend() -> Service:
        return Service(
            "scheduler_svc", [*common, "--role", "frontend"], free_port(), log_dir / f"intake-{loop}-r{running}.log"
        )

    try:
        started = start_all([scheduler, *([frontend] if intake else [])])
    except BaseException:
        stub.stop()
        raise
    return ChainDeployment(stub, started[0], step_log, started[1] if intake else None)
