"""Which executors this scheduler replica steps: membership, leases, reaping.

Every ``lease/3`` the manager heartbeats the replica, reads the membership,
reaps executors whose record expired (their requests go back to the queue),
takes free leases while it leads fewer than its share (``ceil(executors /
replicas)``), so that loops spread over the replicas (one over its share, it
hands a lease back), and aborts requests no stream has held for the detach
timeout. A task per lease renews it. A replica that dies
stops renewing, and its executors' leases pass to the others within a lease
time. Statically configured executors (``--executor``) are registered here on
their behalf, from their ``Info``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TextIO

import grpc
from opentelemetry.trace import Tracer

from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.members import ClusterView, Member, Registry, describe_mismatch
from pagedserve.security import DialFn, insecure
from scheduler_svc.core.migration import MoveConfig
from scheduler_svc.core.request import Finish
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.loops.loop import Loop, _sleep
from scheduler_svc.metrics import LoopMetrics, NamespaceMetrics
from scheduler_svc.state.store import DETACH_TIMEOUT_S, UNAVAILABLE, RedisStore

log = logging.getLogger(__name__)
INFO_TIMEOUT_S = 5.0
TICK_S = 1.0  # at most, between two ticks: how soon an executor that registers gets a loop


@dataclass(slots=True)
class Led:
    """A loop this replica runs, and the task that keeps its lease."""

    task: asyncio.Task[str]
    stop: asyncio.Event
    channel: grpc.aio.Channel
    lease: asyncio.Task[None]


class Manager:
    def __init__(
        self,
        store: RedisStore,
        registry: Registry,
        config: SchedulerConfig,
        replica: str,
        *,
        lease_ms: int = 10_000,
        static: list[str] | None = None,
        executor_timeout: float = 60.0,
        detach_timeout: float = DETACH_TIMEOUT_S,
        step_log: TextIO | None = None,
        metrics: LoopMetrics | None = None,
        namespace_metrics: NamespaceMetrics | None = None,
        tracer: Tracer | None = None,
        dial: DialFn = insecure,
        async_scheduling: bool = False,
        moves: MoveConfig | None = None,
    ) -> None:
        """``dial``: a channel to an executor's address (``pagedserve.security.Dialer.channel``:
        TLS and the internal token as configured). ``async_scheduling``: loops plan a step ahead
        (``scheduler_svc.loops.flights``) wherever the executor serves ``Steps``."""
        self.store = store
        self.registry = registry
        self.config = config
        self.replica = replica
        self.lease_ms = lease_ms
        self.static = static or []
        self.executor_timeout = executor_timeout
        self.detach_ms = int(detach_timeout * 1000)
        self.step_log = step_log
        self.metrics = metrics
        self.namespace_metrics = namespace_metrics
        self.tracer = tracer
        self.dial = dial
        self.async_scheduling = async_scheduling
        self.moves = moves or MoveConfig()  # --migration, --peer-prefix, --rebalance (core/migration.py)
        self.members: dict[str, Member] = {}  # compatible members as of the last tick
        self.loops: dict[str, Led] = {}
        self._refused: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                except UNAVAILABLE as exc:
                    log.warning("redis unavailable (%s); retrying", exc)
                await _sleep(stop, min(TICK_S, self.lease_ms / 3000))
        finally:
            await self.shutdown()

    async def tick(self) -> None:
        await self.registry.beat_replica(self.replica, self.lease_ms)
        for address in self.static:
            await self._register_static(address)
        view = await self.registry.read()
        for eid in view.dead:
            requeued = await self.store.reap(eid)
            log.warning(
                "executor %s stopped heartbeating: reaped, %d requests back in the queue",
                eid,
                requeued,
                extra={"executor": eid},
            )
        await self._fix_identity(view)
        self.members = {m.instance_id: m for m in view.compatible()}
        await self._keep()
        await self._balance(view)
        await self._abort_detached()
        await self._export(view)

    async def _export(self, view: ClusterView) -> None:
        """Namespace gauges, from the one replica holding the metrics lease (one Redis call a tick)."""
        if self.namespace_metrics is None:
            return
        if not await self.store.lead_metrics(self.replica, self.lease_ms):
            self.namespace_metrics.clear()
            return
        states: dict[str, int] = {}
        for m in self.members.values():
            states[m.state] = states.get(m.state, 0) + 1
        self.namespace_metrics.set(view.identity.get("model", ""), await self.store.queued(), states, view.replicas)

    async def _abort_detached(self) -> None:
        """Requests no stream has held for the detach timeout: nobody is waiting for them."""
        for rid in await self.store.detached(self.detach_ms):
            if await self.store.cancel(rid, Finish.ABORT):
                log.info(
                    "%s: no stream attached for %.0f s; aborted", rid, self.detach_ms / 1000, extra={"request_id": rid}
                )

    async def _fix_identity(self, view: ClusterView) -> None:
        if not view.identity and view.members:
            view.identity = await self.registry.fix_identity(next(iter(view.members.values())))
        for m in view.members.values():
            if not m.matches(view.identity) and m.instance_id not in self._refused:
                self._refused.add(m.instance_id)
                log.error(describe_mismatch(m, view.identity))

    async def _keep(self) -> None:
        """Forget loops that ended; stop loops whose executor left the membership."""
        for eid, led in list(self.loops.items()):
            if led.task.done():
                await self._drop(eid)
            elif eid not in self.members:
                led.stop.set()

    async def _renew(self, eid: str, stop: asyncio.Event) -> None:
        """Renew one lease every third of its time, on its own task: neither a slow tick (an
        executor slow to answer Info) nor a long step may let it lapse. A lost lease stops the loop."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.lease_ms / 3000)
                return
            except TimeoutError:
                pass
            try:
                if not await self.store.renew(eid, self.replica, self.lease_ms):
                    log.warning("lease of executor %s lost; stopping its loop", eid)
                    stop.set()
            except UNAVAILABLE as exc:
                log.warning("lease of executor %s not renewed (%s)", eid, exc)

    async def _balance(self, view: ClusterView) -> None:
        share = math.ceil(len(self.members) / max(1, view.replicas))
        active = [eid for eid, led in self.loops.items() if not led.stop.is_set()]  # stopping ones don't count
        for m in self.members.values():
            if len(active) >= share:
                break
            if m.instance_id not in self.loops and await self._try_lead(m):
                active.append(m.instance_id)
        if len(active) > share:
            eid = active[-1]
            log.info("leading %d executors, share is %d: handing %s to another replica", len(active), share, eid)
            self.loops[eid].stop.set()

    async def _try_lead(self, m: Member) -> bool:
        epoch = await self.store.acquire(m.instance_id, self.replica, self.lease_ms)
        if epoch is None:
            return False
        channel = self.dial(m.address)
        stub = pb_grpc.ExecutorStub(channel)
        try:
            info = await stub.Info(pb.InfoRequest(omit_tokenizer_files=True), timeout=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "executor %s at %s does not answer (%s); not leading it yet", m.instance_id, m.address, exc.code().name
            )
            info = None
        if info is None or info.instance_id != m.instance_id:
            await channel.close()
            await self.store.release(m.instance_id, self.replica)
            return False
        stop = asyncio.Event()
        loop = Loop(
            self.store,
            info,
            stub,
            self.config,
            epoch,
            lambda: self.members.get(m.instance_id),
            executor_timeout=self.executor_timeout,
            step_log=self.step_log,
            metrics=self.metrics,
            tracer=self.tracer,
            channel=channel,
            async_scheduling=self.async_scheduling,
            moves=self.moves,
        )
        log.info("replica %s leads executor %s at %s (epoch %d)", self.replica, m.instance_id, m.address, epoch)
        self.loops[m.instance_id] = Led(
            asyncio.create_task(loop.lead(stop)), stop, channel, asyncio.create_task(self._renew(m.instance_id, stop))
        )
        return True

    async def _drop(self, eid: str) -> None:
        led = self.loops.pop(eid)
        led.stop.set()
        outcome = await asyncio.gather(led.task, led.lease, return_exceptions=True)
        if isinstance(outcome[0], BaseException):
            log.error("loop for executor %s failed: %r", eid, outcome[0], exc_info=outcome[0])
        await led.channel.close()
        try:
            await self.store.release(eid, self.replica)
        except UNAVAILABLE:
            pass  # the lease expires on its own

    async def _register_static(self, address: str) -> None:
        """Keep a statically configured executor's membership record alive, as it cannot."""
        async with self.dial(address) as channel:
            stub = pb_grpc.ExecutorStub(channel)
            try:
                info = await stub.Info(pb.InfoRequest(omit_tokenizer_files=True), timeout=INFO_TIMEOUT_S)
                if await self.registry.register(Member.from_info(info, address, static=True), self.lease_ms) is None:
                    # Evicted after a failed step, but still up: it comes back as a new instance.
                    info = await stub.Info(
                        pb.InfoRequest(renew_instance=True, omit_tokenizer_files=True), timeout=INFO_TIMEOUT_S
                    )
                    await self.registry.register(Member.from_info(info, address, static=True), self.lease_ms)
            except grpc.aio.AioRpcError as exc:
                log.debug("static executor %s does not answer: %s", address, exc.code().name)

    async def shutdown(self) -> None:
        for led in self.loops.values():
            led.stop.set()
        for eid in list(self.loops):
            await self._drop(eid)
        try:
            await self.registry.leave_replica(self.replica)
        except UNAVAILABLE:
            pass
