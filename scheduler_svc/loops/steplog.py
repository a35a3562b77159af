"""The loop's step log (``--step-log``): one JSON line per reported step, with where the turn's time went.

A loop's ``Timer`` splits one turn into its parts (Redis, the wait for the executor, building the plan
and the commit, encoding and decoding); ``stats`` joins them with the scheduler's state and the
executor's own report into a ``StepStats`` line. docs/architecture.md lists the fields; the
benchmarks read these lines (``benchmarks/overhead.py``, the pagedserve arms).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from typing import TextIO, TypeVar

from pagedserve.executor.v1 import executor_pb2 as pb
from scheduler_svc.core.blocks import DEVICE
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.loops.flights import Flight

T = TypeVar("T")


@dataclass(slots=True)
class StepStats:
    executor: str
    step: int
    t: float
    running: int
    waiting: int  # in the shared queue
    swapped: int
    scheduled_tokens: int
    live_tokens: int  # tokens whose KV is held on the device
    allocated_slots: int  # device blocks in use x block size
    schedule_ms: float  # the loop's own work: everything but Redis and the Step round trip
    plan_ms: float  # of which: building the step plan
    commit_ms: float  # of which: building the step's Redis commands
    redis_ms: float
    executor_ms: float  # serial: the Step round trip; pipelined: the wait for the oldest result
    forward_ms: float
    step_ms: float  # the executor's own time for the step
    encode_ms: float = 0.0  # pipelined: encoding the plan (part of schedule_ms)
    decode_ms: float = 0.0  # pipelined: decoding the result (part of schedule_ms)
    rtt_ms: float = 0.0  # from sending the reported step's plan to its result (pipelined: spans a loop turn)
    idle_ms: float = 0.0  # the executor's wait for this plan after its previous step (StepResult.idle_ms)
    in_flight: int = 0  # plans sent and not reported after this iteration (pipelined: 1 in steady state)
    seqs: int = 0  # sequences in the step
    lora_seqs: int = 0  # of which on a LoRA adapter
    lora_adapters: list[str] = field(default_factory=list)  # the step's distinct adapters (by digest), by name


@dataclass(slots=True)
class Timer:
    """Milliseconds per part of one loop iteration."""

    redis: float = 0.0
    executor: float = 0.0
    plan: float = 0.0
    commit: float = 0.0
    encode: float = 0.0
    decode: float = 0.0
    total: float = 0.0
    t0: float = 0.0

    def start(self) -> None:
        self.redis = self.executor = self.plan = self.commit = self.encode = self.decode = 0.0
        self.t0 = time.perf_counter()

    def since(self, t: float) -> float:
        """Milliseconds since ``t`` (a ``perf_counter`` reading)."""
        return (time.perf_counter() - t) * 1e3

    async def redis_call(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` (a Redis call), counting its time as Redis time."""
        t = time.perf_counter()
        try:
            return await aw
        finally:
            self.redis += (time.perf_counter() - t) * 1e3

    def stop(self) -> None:
        self.total = (time.perf_counter() - self.t0) * 1e3


def stats(
    executor: str, sched: Scheduler, flight: Flight, result: pb.StepResult, queued: int, timer: Timer, in_flight: int
) -> StepStats:
    """The line for ``flight``'s reported ``result``, from the turn that took it (``timer``) and the
    scheduler's state after it; ``queued``: the shared queue's length, ``in_flight``: plans still out."""
    bm = sched.blocks
    on_adapters = [x.req.lora for x in flight.out.scheduled if x.req.lora is not None]
    return StepStats(
        executor=executor,
        step=flight.step_id,
        t=time.time(),
        running=len(sched.running),
        waiting=queued,
        swapped=len(sched.swapped),
        scheduled_tokens=flight.out.num_tokens,
        live_tokens=sum(r.num_computed for r in sched.running),
        allocated_slots=bm.used(DEVICE) * bm.block_size,
        schedule_ms=timer.total - timer.redis - timer.executor,
        plan_ms=timer.plan,
        commit_ms=timer.commit,
        redis_ms=timer.redis,
        executor_ms=timer.executor,
        forward_ms=result.forward_ms,
        step_ms=result.step_ms,
        encode_ms=timer.encode,
        decode_ms=timer.decode,
        rtt_ms=(time.perf_counter() - flight.sent) * 1e3,
        idle_ms=result.idle_ms,
        in_flight=in_flight,
        seqs=len(flight.out.scheduled),
        lora_seqs=len(on_adapters),
        lora_adapters=sorted({a.digest: a.name for a in on_adapters}.values()),
    )


def write(log: TextIO, line: StepStats) -> None:
    log.write(json.dumps(asdict(line)) + "\n")
    log.flush()
