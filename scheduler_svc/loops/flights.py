"""How a loop hands plans to its executor: one at a time (serial) or one step ahead (pipelined).

Serial: send a plan with the unary ``Step`` and wait for its result before
planning the next. Pipelined (``--async-scheduling``, as vLLM's async
scheduling): plans go out on one ``Steps`` stream, and the loop plans and sends
step N+1 while the executor runs step N, then takes N's result and commits it
while N+1 runs; the executor always has the next plan queued when a step ends.
Plan N+1 is built before N's tokens are known: every sequence N samples is
assumed to yield exactly one token (``Scheduler.launch``), a decoding
sequence's input is "the token you sampled last step" (``from_last_sample``),
and finishes are found one step late, their extra token dropped
(``Scheduler.update``).

A pipelined turn: take step N's result (the executor already runs N+1) while
reading the doorbell from Redis, plan and send N+2, commit N. So at most two
plans are at the executor, and the loop has a whole step to plan the next one.
A plan that moves KV (swaps between tiers, or the copy of a forked group mate's
partial block) is never followed by another before its result is in. A commit
may include later plans' allocations (blocks owned but not yet written,
harmless to reload) and, for their requests, only what reported steps computed
(``Flight.starts``). It records a swap that might not have happened only while
that plan is the one in flight and its seq is above every earlier plan's: the
commit then names the plan's seq (``ExecutorKeys.moving``), and a new leader
whose executor has not applied that seq knows the swaps never ran and resets
the pool (``core/restore.py``). Otherwise (another plan still in flight, a
fork's copy, or a lend, whose registration must come before the commit that
makes its request claimable) the commit waits for the result. So that a swap
does not hold back the tokens of the step before it, a turn takes what its
result changed before it plans, and commits that part alone where the new plan
swaps (``Loop.iterate``).
A plan that runs speculative drafts is not followed by another before its
result is in either: how many tokens each of its rows yields (and so where the
next plan's positions start) is known only then. And drafting needs each
request's last token, so while the draft length policy would draft
(``Scheduler.wants_drafts``) no plan is built with another in flight: with
speculation drafting, the loop is serial; when the policy picks k = 0 (large
batches) it pipelines as before. A turn that had to wait for such a result
sends the next plan right after it (``launch_again``), before its commit, so
the executor waits only for the plan to be built.
After any failure the stream is cancelled; the executor drops the plans queued
on it, and the reloaded loop opens a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from scheduler_svc.core.output import SchedulerOutput
from scheduler_svc.core.request import Request

STEPS_METHOD = "/pagedserve.executor.v1.Executor/Steps"


@dataclass(slots=True)
class Flight:
    """A launched plan whose result is not in yet."""

    out: SchedulerOutput
    step_id: int
    sent: float  # perf_counter() when it was handed to the channel
    starts: dict[str, int] = field(default_factory=dict)  # request -> first position it runs (computed for sure)
    seq: int = 0  # the Redis writes the plan was built on (``StepPlan.seq``)
    fresh: bool = False  # its seq is above every earlier plan's, this leader's and its predecessors' (``Pipeline.add``)

    @classmethod
    def of(cls, out: SchedulerOutput, step_id: int, seq: int = 0) -> Flight:
        return cls(out, step_id, time.perf_counter(), {s.req.request_id: s.start for s in out.scheduled}, seq)

    @property
    def drafts(self) -> bool:
        """It runs drafts: how many tokens it yields per row is unknown until its result is in."""
        return self.out.has_drafts

    @property
    def moves(self) -> bool:
        """It swaps or copies KV, or lends blocks (the commit that makes their request claimable must
        follow the lend's registration): no plan follows it before its result, and a commit records it
        before the result only as ``Pipeline.can_commit`` allows."""
        return bool(self.out.swap_out or self.out.swap_in or self.out.copies or self.out.lends)

    @property
    def swaps_only(self) -> bool:
        """Its moves are swaps between tiers: no fork's copy, no lend."""
        return not (self.out.copies or self.out.lends)


class Pipeline:
    """The plans in flight, oldest first; the pure rules of when to launch, wait and commit."""

    def __init__(self, depth: int, seq: int = 0) -> None:
        self.depth = depth  # 1: serial, 2: one step ahead
        self.flights: deque[Flight] = deque()
        # The highest seq a plan the executor may have run carries: at first the leader's restored seq (no
        # predecessor's plan carries more), then the seq of this leader's latest plan (they go out in order).
        self._last_seq = seq

    def __len__(self) -> int:
        return len(self.flights)

    def can_launch(self, drafting: bool = False) -> bool:
        """Room for another plan, and none in flight moves KV (its swaps must be reported first) or runs
        drafts (the next plan's positions depend on how many were accepted). ``drafting``: the next plan
        would draft (``Scheduler.wants_drafts``), which needs every decoding request's last token: only
        with nothing in flight."""
        if drafting and self.flights:
            return False
        return len(self.flights) < self.depth and not any(f.moves or f.drafts for f in self.flights)

    def wait_first(self) -> bool:
        """At the start of a pipelined turn the executor holds ``depth`` plans: take the oldest result,
        then plan the next one while the executor runs the other."""
        return self.depth > 1 and len(self.flights) >= self.depth

    def wait_after(self, launched: bool) -> bool:
        """After planning: serial, the result of the plan just sent; pipelined, the oldest result only
        when nothing new went out (the pipeline drains)."""
        return bool(self.flights) and (self.depth == 1 or not launched)

    def launch_again(self, launched: bool) -> bool:
        """Pipelined: a turn that sent nothing (a plan in flight moved KV or ran drafts) and then took
        that plan's result tries to send the next plan at once, before its commit: the executor then
        waits only for the plan, not for the commit and the next turn's reads from Redis (speculation at
        small batches makes every turn such a turn)."""
        return self.depth > 1 and not launched

    def can_commit(self) -> bool:
        """Whether a commit may record what the scheduler holds now. A plan in flight that moves KV may have
        its moves recorded before its result only where a new leader can tell whether they ran: it is the one
        plan in flight, its seq is above every earlier plan's (``moving``), and it only swaps (a fork's copy
        and a lend wait for their result)."""
        moving = [f for f in self.flights if f.moves]
        return not moving or (len(self.flights) == 1 and moving[0].fresh and moving[0].swaps_only)

    def moving(self) -> int:
        """The seq a commit made now names as the plan whose moves it records before their result, 0 if none:
        the executor reaches that seq only by starting that plan (it refuses a seq below one it ran)."""
        return next((f.seq for f in self.flights if f.moves), 0)

    def add(self, flight: Flight) -> None:
        """A plan went out. The requests it preempted start over (and may be admitted again in this
        very plan, from a prefix hit or from nothing): what older plans in flight run for them is no
        longer theirs to count as computed."""
        gone = {r.request_id for r in flight.out.preempted}
        for f in self.flights:
            for rid in gone & f.starts.keys():
                del f.starts[rid]
        flight.fresh = flight.seq > self._last_seq
        self._last_seq = max(self._last_seq, flight.seq)
        self.flights.append(flight)

    def starts(self, live: Mapping[str, Request] | None = None) -> dict[str, int]:
        """request -> what it has computed for sure, for the requests in launched plans. ``live``:
        the scheduler's requests; a plan's entry for a request that left since (requeued, then
        claimed back as another object while the plan was still in flight) is not the live one's."""
        merged: dict[str, int] = {}
        for f in reversed(self.flights):  # the oldest plan's start wins
            ran = {s.req.request_id: s.req for s in f.out.scheduled} if live is not None else {}
            for rid, start in f.starts.items():
                if rid not in ran or live.get(rid) is ran[rid]:  # type: ignore[union-attr]
                    merged[rid] = start
        return merged


def _lost(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class UnaryChannel:
    """The serial path: each plan is a unary ``Step``."""

    def __init__(self, stub: pb_grpc.ExecutorStub, timeout: float) -> None:
        self.stub = stub
        self.timeout = timeout
        self._calls: deque[asyncio.Future[pb.StepResult]] = deque()

    def send(self, plan: pb.StepPlan) -> float:
        self._calls.append(asyncio.ensure_future(self.stub.Step(plan, timeout=self.timeout)))
        return 0.0

    async def result(self) -> tuple[pb.StepResult, float]:
        return await self._calls.popleft(), 0.0

    def close(self) -> None:
        for call in self._calls:
            call.cancel()
        self._calls.clear()


class StreamChannel:
    """The pipelined path: one ``Steps`` stream per loop session. Plans are encoded here, and
    results decoded here, so that the step log can tell encoding and decoding apart from the wait."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self.timeout = timeout
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._call = channel.stream_stream(STEPS_METHOD, request_serializer=None, response_deserializer=None)(
            self._plans()
        )

    async def _plans(self):
        while (data := await self._out.get()) is not None:
            yield data

    def send(self, plan: pb.StepPlan) -> float:
        """Queue ``plan`` on the stream; returns the milliseconds spent encoding it."""
        t = time.perf_counter()
        data = plan.SerializeToString()
        self._out.put_nowait(data)
        return (time.perf_counter() - t) * 1e3

    async def result(self) -> tuple[pb.StepResult, float]:
        """The oldest plan's result, and the milliseconds spent decoding it."""
        try:
            data = await asyncio.wait_for(self._call.read(), self.timeout)
        except TimeoutError:
            self.close()
            raise _lost(f"no StepResult within {self.timeout} s") from None
        if data is grpc.aio.EOF:
            raise _lost("the executor ended the Steps stream")
        t = time.perf_counter()
        result = pb.StepResult.FromString(data)
        return result, (time.perf_counter() - t) * 1e3

    def close(self) -> None:
        """End the stream: the executor drops whatever is still queued on it."""
        self._out.put_nowait(None)
        self._call.cancel()
