"""The scheduling loop: the I/O around the pure ``Scheduler``.

One replica at a time runs it, holding a lease in Redis; its epoch fences
every commit so a deposed leader cannot write. Per step: read new operations
from the incoming stream, decide (pure), run the plan on the executor, apply
the result (pure), commit everything in one atomic Redis call. If anything
fails in between, the in-memory state is thrown away and reloaded from the
last commit, which the executor's KV still matches (KV writes are idempotent
and swaps copy without destroying their source).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import TextIO

import grpc

from scheduler_svc.core.blocks import TIERS, BlockManager, Pool
from scheduler_svc.core.request import Finish, Request
from scheduler_svc.core.scheduler import Counters, Scheduler, SchedulerConfig
from scheduler_svc.plan import PlanBuilder
from scheduler_svc.store import UNAVAILABLE, Commit, Fenced, Incoming, RedisStore
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

IDLE_BLOCK_MS = 200
RETRY_S = 1.0


def consistent(bm: BlockManager, requests: list[Request]) -> bool:
    """Every block is either free or owned by exactly one request."""
    owned: list[set[int]] = [set(), set(), set()]
    for req in requests:
        for tier, block in [(0, b) for b in req.blocks] + req.swap_blocks:
            if block in owned[tier] or block >= bm.total(tier) or bm.is_free(tier, block):
                return False
            owned[tier].add(block)
    return all(len(owned[t]) + bm.num_free(t) == bm.total(t) for t in TIERS)


@dataclass(slots=True)
class StepStats:
    step: int
    t: float
    running: int
    waiting: int
    swapped: int
    scheduled_tokens: int
    live_tokens: int  # tokens whose KV is held on the device
    allocated_slots: int  # device blocks in use x block size
    schedule_ms: float
    redis_ms: float
    executor_ms: float
    forward_ms: float


class Loop:
    def __init__(
        self,
        store: RedisStore,
        executor: pb_grpc.ExecutorStub,
        config: SchedulerConfig,
        replica: str,
        lease_ms: int = 10_000,
        step_log: TextIO | None = None,
    ) -> None:
        self.store = store
        self.executor = executor
        self.config = config
        self.replica = replica
        self.lease_ms = lease_ms
        self.step_log = step_log
        self._in_flight: list[str] = []  # requests in the plan the executor is running

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                epoch = await self.store.acquire(self.replica, self.lease_ms)
            except UNAVAILABLE as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                epoch = None
            if epoch is None:
                await _sleep(stop, self.lease_ms / 3000)
                continue
            log.info("replica %s leads the scheduling loop (epoch %d)", self.replica, epoch)
            renew = asyncio.create_task(self._keep_lease(stop))
            try:
                await self._lead(epoch, stop)
            except Fenced as exc:
                log.warning("lost leadership: %s", exc)
            finally:
                renew.cancel()
                await self.store.release(self.replica)

    async def _keep_lease(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.lease_ms / 3000)
            if not await self.store.renew(self.replica, self.lease_ms):
                log.warning("lease renewal failed; the epoch check will stop stale commits")

    async def _lead(self, epoch: int, stop: asyncio.Event) -> None:
        rejected: list[str] = []
        while not stop.is_set():
            try:
                info = await self.executor.Info(pb.InfoRequest(), timeout=10)
                sched, cursor = await self._restore(info, epoch)
                if rejected:
                    await self._reject(sched, rejected, epoch)
                    rejected = []
                await self._steps(sched, cursor, epoch, stop)
            except grpc.aio.AioRpcError as exc:
                # FAILED_PRECONDITION (the executor lacks a block table) heals here too:
                # the reload starts a fresh PlanBuilder, which sends every table in full.
                log.warning("executor call failed (%s: %s); reloading state", exc.code().name, exc.details())
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    rejected = self._in_flight
                await _sleep(stop, RETRY_S)
            except UNAVAILABLE as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                await _sleep(stop, RETRY_S)

    async def _reject(self, sched: Scheduler, ids: list[str], epoch: int) -> None:
        """The executor refused a plan: end its requests rather than retry them forever."""
        commit = Commit(blocks=sched.blocks)
        for rid in ids:
            req = sched.finish(rid, Finish.ABORT)
            if req is not None:
                log.error("aborting %s: the executor rejected its step", rid)
                commit.finished.append(req)
        await self.store.apply(epoch, self.store.commit_ops(commit))

    async def _restore(self, info: pb.InfoResponse, epoch: int) -> tuple[Scheduler, str]:
        snap = await self.store.load()
        totals = (info.num_gpu_blocks, info.num_cpu_blocks, info.num_disk_blocks)
        meta = {"instance_id": info.instance_id, "block_size": str(info.block_size), "blocks": ",".join(map(str, totals))}
        pools = [Pool.with_free(total, [b for b in free if b < total]) for total, free in zip(totals, snap.free)]
        bm = BlockManager(info.block_size, *pools)
        if snap.meta != meta or not consistent(bm, snap.requests):
            if snap.meta and snap.meta.get("instance_id") == info.instance_id:
                log.error("block ownership in redis is inconsistent; resetting every pool")
            elif snap.requests:
                log.warning("executor changed: %d live requests will be recomputed", len(snap.requests))
            await self.store.apply(epoch, self.store.reset_ops(meta, totals, snap.requests))
            for req in snap.requests:
                req.blocks, req.swap_blocks, req.num_computed = [], [], 0
                req.status = req.status.WAITING
            bm = BlockManager(info.block_size, *(Pool.fresh(t) for t in totals))
        config = replace(
            self.config,
            max_model_len=min(self.config.max_model_len or info.max_model_len, info.max_model_len),
            eos_token_ids=tuple(info.eos_token_ids),
        )
        sched = Scheduler(config, bm)
        for req in sorted(snap.requests, key=lambda r: r.arrival):
            sched.add(req)
        sched.counters = Counters(**{k: v for k, v in snap.counters.items() if k in Counters.__slots__})
        log.info("restored %d live requests; blocks free %s", len(snap.requests), [bm.num_free(t) for t in TIERS])
        return sched, snap.cursor

    async def _intake(self, sched: Scheduler, items: list[Incoming], commit: Commit) -> None:
        submitted = await self.store.load_submitted([i.request_id for i in items if i.op == "submit"])
        for item in items:
            if item.op == "submit":
                req = submitted.pop(item.request_id, None)
                if req is None or item.request_id in sched.requests:
                    continue
                sched.add(req)
                if not sched.fits_ever(min(req.num_tokens + req.params.max_tokens, sched.config.max_model_len)):
                    # The pool shrank (a new executor) since the frontend checked it.
                    log.error("%s can never fit the KV pool; aborting it", req.request_id)
                    commit.finished.append(sched.finish(req.request_id, Finish.ABORT))
                    continue
                commit.admitted.append(req.request_id)
                commit.touched[req.request_id] = req
            else:
                done = sched.finish(item.request_id, Finish.STOP if item.op == "stop" else Finish.ABORT)
                if done is not None:
                    commit.finished.append(done)

    async def _steps(self, sched: Scheduler, cursor: str, epoch: int, stop: asyncio.Event) -> None:
        step_id = sched.counters.steps
        busy = sched.has_work
        plans = PlanBuilder()
        ended: list[str] = []  # finished since the last plan: the executor may drop their tables
        while not stop.is_set():
            t0 = time.perf_counter()
            items = await self.store.read_incoming(cursor, None if busy else IDLE_BLOCK_MS)
            t1 = time.perf_counter()
            commit = Commit(blocks=sched.blocks)
            if items:
                await self._intake(sched, items, commit)
                cursor = commit.cursor = items[-1].stream_id
            t2 = time.perf_counter()
            exec_ms = forward_ms = 0.0
            out = None
            if sched.has_work:
                out = sched.schedule()
                sampled: dict[str, int] = {}
                t3 = time.perf_counter()
                if out.scheduled or out.swap_out or out.swap_in:
                    self._in_flight = [s.req.request_id for s in out.scheduled]
                    result = await self.executor.Step(plans.build(out, step_id, ended))
                    ended = []
                    sampled = {o.request_id: o.token_id for o in result.outputs}
                    forward_ms = result.forward_ms
                    step_id += 1
                t4 = time.perf_counter()
                exec_ms = (t4 - t3) * 1e3
                commit.record_step(sched, out, sampled)
            busy = out is not None and bool(out.scheduled or out.swap_out or out.swap_in)
            if items or out is not None:
                commit.record_totals(sched)
            t5 = time.perf_counter()
            ended += [r.request_id for r in commit.finished]
            ops = self.store.commit_ops(commit)
            if ops:
                await self.store.apply(epoch, ops)
            t6 = time.perf_counter()
            if self.step_log is not None and out is not None:
                self._log_step(sched, out.num_tokens, step_id, t0, t1, t2, t5, t6, exec_ms, forward_ms)

    def _log_step(self, sched: Scheduler, tokens: int, step: int, t0: float, t1: float, t2: float,
                  t5: float, t6: float, exec_ms: float, forward_ms: float) -> None:
        bm = sched.blocks
        used = bm.total(0) - bm.num_free(0)
        stats = StepStats(
            step=step,
            t=time.time(),
            running=len(sched.running),
            waiting=len(sched.waiting),
            swapped=len(sched.swapped),
            scheduled_tokens=tokens,
            live_tokens=sum(r.num_computed for r in sched.running),
            allocated_slots=used * bm.block_size,
            schedule_ms=(t5 - t2) * 1e3 - exec_ms,
            redis_ms=((t1 - t0) + (t6 - t5)) * 1e3,
            executor_ms=exec_ms,
            forward_ms=forward_ms,
        )
        assert self.step_log is not None
        self.step_log.write(json.dumps({name: getattr(stats, name) for name in StepStats.__slots__}) + "\n")
        self.step_log.flush()


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
