"""CPU time per output token, by process role, for a server under load (issue #28, part 3).

Wall-clock figures on a shared 2-core machine move with whatever else runs; the CPU seconds each process spends
do much less. ``Meter`` snapshots the CPU time (user + system) of every process in the trees under the roots it is
given, names each process's role from its command line, and ``per_token`` divides what each role spent between two
snapshots by the output tokens served meanwhile. For pagedserve the roles are the executor, the scheduler's
frontend (public gRPC and HTTP door), its scheduling loop (a child process) and redis-server; for vLLM its API
server, its engine core (scheduling, a child) and the engine core's worker (the model runner, a grandchild).
``client`` is this process: the load generator, on the same cores.

The serving path is everything but the compute: what ``serving_ms_per_token`` sums is CPU taken from the cores the
forward pass wants, whether it runs on them at the same instant or not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil

COMPUTE = frozenset({"executor", "worker"})  # the roles that run the model's forward pass


def pagedserve_role(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    if "redis-server" in line:
        return "redis"
    if "executor_svc" in line:
        return "executor"
    if "scheduler_svc" in line:
        return "loop" if "--role loop" in line else "frontend"
    return "other"


def vllm_role(cmdline: list[str]) -> str:
    """vLLM 0.32 titles its processes (setproctitle): ``VLLM::APIServer``, ``VLLM::EngineCore`` (the scheduler, the
    outputs) and ``VLLM::Worker`` (the model runner: the forward pass)."""
    line = " ".join(cmdline)
    if "VLLM::Worker" in line:
        return "worker"
    if "EngineCore" in line:
        return "engine_core"
    if "APIServer" in line or ("vllm" in line and "serve" in line):  # titled, or still its command line
        return "api_server"
    return "other"


def _tree(pids: Iterable[int]) -> list[psutil.Process]:
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return procs


@dataclass(slots=True)
class Meter:
    """CPU seconds per role over the process trees under ``roots`` (pids), plus this process as ``client``."""

    roots: list[int]
    role: Callable[[list[str]], str]
    start: dict[str, float] = field(default_factory=dict)

    def snapshot(self) -> dict[str, float]:
        spent: dict[str, float] = {}
        for p in _tree(self.roots):
            try:
                t, name = p.cpu_times(), self.role(p.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            spent[name] = spent.get(name, 0.0) + t.user + t.system
        me = psutil.Process(os.getpid()).cpu_times()
        spent["client"] = me.user + me.system
        return spent

    def begin(self) -> None:
        self.start = self.snapshot()

    def per_token(self, tokens: int) -> dict[str, float]:
        """Milliseconds of CPU per output token since ``begin``, per role, with ``serving`` and ``total`` sums."""
        end = self.snapshot()
        out = {k: round(1e3 * (v - self.start.get(k, 0.0)) / max(tokens, 1), 3) for k, v in sorted(end.items())}
        out["serving"] = round(sum(v for k, v in out.items() if k not in COMPUTE and k != "client"), 3)
        out["total"] = round(sum(v for k, v in out.items() if k not in ("serving",)), 3)
        return out


def settle(meters: Iterable[Meter], quiet_s: float = 0.05, window_s: float = 1.0, most_s: float = 30.0) -> float:
    """Wait until the servers under ``meters`` spend under ``quiet_s`` of CPU in a ``window_s`` window (``most_s``
    at most), so that a run does not share the cores with the last run's tail: vLLM's processes spent ~1 s of CPU
    in the 10 s after a run of the long workload, 0.15 s in the next 10 (2026-12-06). Returns the seconds waited.
    The client's own CPU (``Meter``'s ``client``) is not counted."""
    meters = list(meters)

    def spent() -> float:
        return sum(v for m in meters for k, v in m.snapshot().items() if k != "client")

    t0 = time.monotonic()
    while True:
        before = spent()
        time.sleep(window_s)
        if spent() - before < quiet_s or time.monotonic() - t0 >= most_s:
            return round(time.monotonic() - t0, 1)
