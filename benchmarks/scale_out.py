"""Scale-out: aggregate throughput as executors are added behind two scheduler replicas.

Per point (1, 2, 4, 8 executors by default), a fresh redis-server, N stub
executors that register themselves (``benchmarks.stub_executor --redis-url``)
and simulate a ``--step-ms`` forward pass (20 ms, a GPU decode step's order),
and 2 real scheduler_svc replicas with no ``--executor``, which spread one
loop per executor between them. One asyncio client submits N x R long requests
(``max_tokens`` 8192, ``ignore_eos``: none finishes in the window) alternately
to both replicas, over a few channels, and keeps every stream attached
without reading it after its first message (a closed stream aborts its
request; an unread one costs the client almost nothing, while the frontend
still streams every token). Once every executor runs R and the loops are
balanced over the replicas, a window of the replicas' step logs gives:

- steps/s and tokens/s over all executors (decode steps: one token per
  running sequence, so tokens = sum of ``scheduled_tokens``);
- each executor's duty cycle: sum of its ``step_ms`` (time inside the stub's
  Step) / window; 1.0 would mean its loop never keeps it waiting;
- CPU cores used per kind of process over the window (psutil): the client
  (this process), the frontends, the loop processes, the stubs, Redis; and the
  machine's busy fraction, since every process shares the same cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import psutil
import redis

from benchmarks.overhead import StepTail, hold
from pagedserve.dev.procs import RedisServer, Service, free_port, start_all, stop_all
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SETTLE_S = 1.0  # after the target is reached: let the intake burst and any handover pass
POLL_S = 0.25


@dataclass(slots=True)
class ScaleOutConfig:
    executors: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    running: int = 64  # per executor (the schedulers' --max-num-seqs)
    window_s: float = 5.0
    step_ms: float = 20.0
    replicas: int = 2
    channels_per_replica: int = 2
    prompt_len: int = 8
    # The schedulers' --lease-ms. Their managers tick every third of it; a replica that started first may take
    # every loop and hand the extra ones over one per tick: 3 s settles that within seconds.
    lease_ms: int = 3000
    reach_timeout_s: float = 120.0
    log_level: str = "WARNING"  # the schedulers' and stubs'


@dataclass(slots=True)
class ScaleOutPoint:
    executors: int
    running: int  # per executor
    window_s: float
    steps: int
    steps_per_s: float
    tokens_per_s: float
    ideal_tokens_per_s: float  # executors x running / step time: a loop that never keeps its executor waiting
    duty_cycles: list[float]  # per executor: time inside Step / window
    mean_duty: float
    stub_step_ms_p50: float  # the stubs' own time per Step: step_ms plus how late the event loop woke them
    step_gap_ms_p50: float  # per executor, wall time per step outside the stub's Step (the loop's own time)
    overhead_ms_p50: float  # schedule_ms + redis_ms + (executor_ms - step_ms): the loop's time per step
    schedule_ms_p50: float
    redis_ms_p50: float
    rpc_ms_p50: float  # the Step round trip minus the stub's own time
    loops_per_replica: list[int]
    cpu_cores: dict[str, float]  # CPU seconds / window per kind of process
    machine_busy: float  # fraction of all cores busy over the window


@dataclass(slots=True)
class Deployment:
    """One point's processes; ``procs`` maps a kind (client, frontends, loops, stubs, redis) to pids."""

    redis: RedisServer
    namespace: str
    stubs: list[Service]
    schedulers: list[Service]
    step_logs: list[Path]

    def procs(self) -> dict[str, list[psutil.Process]]:
        fronts = [psutil.Process(s.proc.pid) for s in self.schedulers]
        return {
            "client": [psutil.Process(os.getpid())],
            "frontends": fronts,
            "loops": [c for f in fronts for c in f.children(recursive=True)],
            "stubs": [psutil.Process(s.proc.pid) for s in self.stubs],
            "redis": [psutil.Process(self.redis.proc.pid)],
        }

    def stop(self) -> None:
        stop_all(self.schedulers)
        stop_all(self.stubs)
        self.redis.stop()


def deploy(model_dir: Path, n: int, cfg: ScaleOutConfig, log_dir: Path) -> Deployment:
    log_dir.mkdir(parents=True, exist_ok=True)
    redis_srv = RedisServer()
    ns = f"scaleout{n}"
    try:

        def stub(i: int) -> Service:
            port = free_port()
            return Service(
                "benchmarks.stub_executor",
                [
                    "--model",
                    str(model_dir),
                    "--host",
                    "127.0.0.1",
                    "--step-ms",
                    str(cfg.step_ms),
                    "--redis-url",
                    redis_srv.url,
                    "--advertise-address",
                    f"127.0.0.1:{port}",
                    "--namespace",
                    ns,
                    "--log-level",
                    cfg.log_level,
                ],
                port,
                log_dir / f"stub-{n}-{i}.log",
            )

        logs = [log_dir / f"steps-{n}-r{i}.jsonl" for i in range(cfg.replicas)]
        for path in logs:
            path.unlink(missing_ok=True)

        def scheduler(i: int) -> Service:
            return Service(
                "scheduler_svc",
                [
                    "--redis-url",
                    redis_srv.url,
                    "--namespace",
                    ns,
                    "--replica-id",
                    f"r{i}",
                    "--max-num-seqs",
                    str(cfg.running),
                    "--max-num-batched-tokens",
                    str(max(2048, cfg.running * cfg.prompt_len)),
                    "--lease-ms",
                    str(cfg.lease_ms),
                    "--step-log",
                    str(logs[i]),
                    "--log-level",
                    cfg.log_level,
                ],
                free_port(),
                log_dir / f"scheduler-{n}-r{i}.log",
            )

        # All at once: a replica is healthy once some executor has registered.
        started = start_all(
            [lambda i=i: stub(i) for i in range(n)] + [lambda i=i: scheduler(i) for i in range(cfg.replicas)]
        )
    except BaseException:
        redis_srv.stop()
        raise
    return Deployment(redis_srv, ns, started[:n], started[n:], logs)


class Leaders:
    """Which replica leads each registered executor (the loop leases in Redis)."""

    def __init__(self, url: str, namespace: str) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.keys = Keys(namespace)

    def read(self) -> dict[str, str | None]:
        eids = self.r.zrange(self.keys.members, 0, -1)
        return {e: self.r.get(self.keys.executor(e).leader) for e in eids}

    def close(self) -> None:
        self.r.close()


def _balanced(leaders: dict[str, str | None], n: int, replicas: int) -> bool:
    counts = Counter(leaders.values())
    return len(leaders) == n and None not in counts and max(counts.values(), default=0) <= math.ceil(n / replicas)


def _at_target(tails: list[StepTail], n: int, running: int, since: float) -> bool:
    """Every executor's latest step (after ``since``) runs ``running``."""
    last: dict[str, dict[str, float]] = {}
    for tail in tails:
        for row in tail.poll():
            if row["t"] >= since and row["t"] >= last.get(row["executor"], {"t": 0.0})["t"]:
                last[row["executor"]] = row
    return len(last) == n and all(r["running"] == running for r in last.values())


def _diagnose(tails: list[StepTail], leaders: dict[str, str | None]) -> str:
    """Per registered executor: the replica holding its lease, and the last step its loop logged."""
    now, last = time.time(), {}
    for i, tail in enumerate(tails):
        for row in tail.poll():
            last[row["executor"]] = (f"r{i}", row["running"], now - row["t"])
    parts = []
    for eid, holder in sorted(leaders.items()):
        step = last.get(eid)
        seen = f"last step by {step[0]} {step[2]:.1f} s ago, running {step[1]}" if step else "never stepped"
        parts.append(f"{eid[:8]}: lease {holder or 'free'}, {seen}")
    return "; ".join(parts) or "no executor registered"


def _cpu(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind, ps in procs.items():
        total = 0.0
        for p in ps:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        out[kind] = total
    return out


async def _measure(dep: Deployment, n: int, cfg: ScaleOutConfig) -> ScaleOutPoint | None:
    prompt = list(range(100, 100 + cfg.prompt_len))
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(s.address, options=options)
        for s in dep.schedulers
        for _ in range(cfg.channels_per_replica)
    ]
    stubs = [pb_grpc.GenerationStub(ch) for ch in channels]
    tails = [StepTail(p) for p in dep.step_logs]
    leaders = Leaders(dep.redis.url, dep.namespace)
    t0 = time.time()
    tasks = [asyncio.create_task(hold(stubs[i % len(stubs)], prompt, f"so-{n}-{i}")) for i in range(n * cfg.running)]
    try:
        deadline = time.monotonic() + cfg.reach_timeout_s
        while not (
            _at_target(tails, n, cfg.running, t0) and _balanced(await asyncio.to_thread(leaders.read), n, cfg.replicas)
        ):
            if time.monotonic() > deadline:
                print(
                    f"[scale_out] {n} executors never reached {cfg.running} running each on balanced loops "
                    f"within {cfg.reach_timeout_s:.0f} s; skipped. "
                    f"{_diagnose(tails, await asyncio.to_thread(leaders.read))}",
                    flush=True,
                )
                return None
            await asyncio.sleep(POLL_S)
        log.info("%d executors: at target and balanced after %.1f s", n, time.time() - t0)
        await asyncio.sleep(SETTLE_S)
        procs = dep.procs()
        cpu0, sys0, start = _cpu(procs), psutil.cpu_times(), time.time()
        await asyncio.sleep(cfg.window_s)
        cpu1, sys1, end = _cpu(procs), psutil.cpu_times(), time.time()
        lead = await asyncio.to_thread(leaders.read)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close()
        leaders.close()
    rows = [r for tail in tails for r in tail.poll() if start <= r["t"] <= end]
    busy = 1 - (sys1.idle - sys0.idle) / max(1e-9, sum(sys1) - sum(sys0))
    cpu = {k: (cpu1[k] - cpu0[k]) / (end - start) for k in cpu0}
    cpu["other"] = max(0.0, busy * (psutil.cpu_count() or 1) - sum(cpu.values()))  # not this benchmark's
    return _point(rows, n, cfg, end - start, lead, cpu, busy)


def _point(
    rows: list[dict[str, float]],
    n: int,
    cfg: ScaleOutConfig,
    window: float,
    leaders: dict[str, str | None],
    cpu: dict[str, float],
    busy: float,
) -> ScaleOutPoint:
    by_exec: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in rows:
        by_exec[r["executor"]].append(r)
    duty = [sum(r["step_ms"] for r in by_exec.get(e, [])) / (window * 1e3) for e in sorted(leaders)]
    gaps = [r["executor_ms"] - r["step_ms"] + r["schedule_ms"] + r["redis_ms"] for r in rows]
    med = lambda xs: float(np.median(xs)) if xs else math.nan  # noqa: E731
    counts = Counter(leaders.values())
    return ScaleOutPoint(
        executors=n,
        running=cfg.running,
        window_s=window,
        steps=len(rows),
        steps_per_s=len(rows) / window,
        tokens_per_s=sum(r["scheduled_tokens"] for r in rows) / window,
        ideal_tokens_per_s=n * cfg.running * 1e3 / cfg.step_ms if cfg.step_ms > 0 else math.nan,
        duty_cycles=duty,
        mean_duty=float(np.mean(duty)) if duty else math.nan,
        stub_step_ms_p50=med([r["step_ms"] for r in rows]),
        step_gap_ms_p50=med(_step_gaps(by_exec)),
        overhead_ms_p50=med(gaps),
        schedule_ms_p50=med([r["schedule_ms"] for r in rows]),
        redis_ms_p50=med([r["redis_ms"] for r in rows]),
        rpc_ms_p50=med([r["executor_ms"] - r["step_ms"] for r in rows]),
        loops_per_replica=[counts.get(f"r{i}", 0) for i in range(cfg.replicas)],
        cpu_cores=cpu,
        machine_busy=busy,
    )


def _step_gaps(by_exec: dict[str, list[dict[str, float]]]) -> list[float]:
    """Per executor, wall time per step spent outside the stub's Step (its loop's own time, whatever it
    was waiting for): the time between consecutive step-log rows less the later step's ``step_ms``."""
    out: list[float] = []
    for rows in by_exec.values():
        rows = sorted(rows, key=lambda r: r["t"])
        out += [(b["t"] - a["t"]) * 1e3 - b["step_ms"] for a, b in zip(rows, rows[1:])]
    return out


def sweep(model_dir: Path, cfg: ScaleOutConfig, log_dir: Path) -> list[ScaleOutPoint]:
    """Every point on a fresh deployment; one point's teardown overlaps the next one's start-up (never a window)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    points: list[ScaleOutPoint] = []
    stopping: threading.Thread | None = None
    try:
        for n in cfg.executors:
            t = time.monotonic()
            try:
                dep = deploy(model_dir, n, cfg, log_dir)
            finally:
                if stopping is not None:
                    stopping.join()
                    stopping = None
            log.info("%d executors: deployed in %.1f s", n, time.monotonic() - t)
            try:
                point = asyncio.run(_measure(dep, n, cfg))
            finally:
                stopping = threading.Thread(target=dep.stop)
                stopping.start()
            if point is not None:
                points.append(point)
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in point.cpu_cores.items())
                print(
                    f"[scale_out] {n} executors: {point.tokens_per_s:.0f} tok/s, {point.steps_per_s:.1f} steps/s, "
                    f"mean duty {point.mean_duty:.2f}, CPU cores: {cpu} ({time.monotonic() - t:.0f} s)",
                    flush=True,
                )
    finally:
        if stopping is not None:
            stopping.join()
    return points


def efficiency(points: list[ScaleOutPoint], n: int) -> float | None:
    """tokens/s at ``n`` executors / (n x tokens/s at 1)."""
    by_n = {p.executors: p.tokens_per_s for p in points}
    if n not in by_n or not by_n.get(1):
        return None
    return by_n[n] / (n * by_n[1])
