"""One executor's scheduling loop: the I/O around its pure ``Scheduler``.

A ``Manager`` starts one ``Loop`` per executor it leads (holding that
executor's lease; the epoch fences every write). Per step: read the doorbell
stream (cancellations), claim queued requests that placement gives this
executor, decide (pure), send the plan to the executor, apply the oldest
result (pure), commit everything in one fenced Redis call. Serial, the plan
sent is the one whose result comes back; pipelined (``scheduler_svc.loops.flights``),
the loop sends step N+1 before it takes step N's result, so the executor never
waits for the loop. If anything fails in between, the in-memory state is thrown
away and reloaded from the last commit, which the executor's KV still matches
(KV writes are idempotent and swaps copy without destroying their source). If
the executor itself is lost, its requests go back to the shared queue and the
loop ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TextIO

import grpc
from opentelemetry.trace import Tracer

from pagedserve import logs
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.members import DRAINING, Member, now_ms
from scheduler_svc.core import placement
from scheduler_svc.core.blocks import DEVICE
from scheduler_svc.core.migration import MoveConfig
from scheduler_svc.core.output import SchedulerOutput
from scheduler_svc.core.record import StepRecord
from scheduler_svc.core.request import Finish, Request
from scheduler_svc.core.restore import intake, restore
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.loops import steplog
from scheduler_svc.loops.flights import Flight, Pipeline, StreamChannel, UnaryChannel
from scheduler_svc.loops.moves import Mover
from scheduler_svc.loops.plan import PlanBuilder, outputs, pulls_of
from scheduler_svc.loops.stays import Placements
from scheduler_svc.metrics import LoopMetrics
from scheduler_svc.state.commit import CommitWriter
from scheduler_svc.state.store import UNAVAILABLE, Fenced, RedisStore, Stale

log = logging.getLogger(__name__)

IDLE_BLOCK_MS = 200
RETRY_S = 1.0


class ExecutorLost(RuntimeError):
    """Step failed or timed out and the executor did not answer as the same instance."""


Written = tuple[StepRecord, list[list[str]]]  # what a commit writes: the record taken, its Redis commands


@dataclass(slots=True)
class Session:
    """What one leadership of a loop keeps between steps."""

    sched: Scheduler
    writer: CommitWriter
    plans: PlanBuilder
    cursor: str  # the doorbell stream, read up to here
    seq: int  # writes of the executor's state in Redis: what the next fenced write expects
    ended: list[str] = field(default_factory=list)  # left this executor since the last plan: tables to drop
    retry: bool = False  # placement gave us requests another loop took first: look again at once
    timer: steplog.Timer = field(default_factory=steplog.Timer)
    pipe: Pipeline = field(default_factory=lambda: Pipeline(1))
    channel: UnaryChannel | StreamChannel | None = None
    # The executor may hold lends of an earlier session (they were freed at restore): the first plan, which
    # resets its tables and lends, goes out even with nothing to run, or a drained executor would wait for them.
    hello: bool = False
    moving: int = 0  # the seq Redis names as a plan whose moves it records before their result (flights.py)


class Loop:
    def __init__(
        self,
        store: RedisStore,
        info: pb.InfoResponse,
        stub: pb_grpc.ExecutorStub,
        config: SchedulerConfig,
        epoch: int,
        member: Callable[[], Member | None],
        *,
        executor_timeout: float = 60.0,
        step_log: TextIO | None = None,
        metrics: LoopMetrics | None = None,
        tracer: Tracer | None = None,
        channel: grpc.aio.Channel | None = None,
        async_scheduling: bool = False,
        moves: MoveConfig | None = None,
    ) -> None:
        self.store = store
        self.info = info
        self.executor = info.instance_id
        self.stub = stub
        self.config = replace(
            config,
            max_model_len=min(config.max_model_len or info.max_model_len, info.max_model_len),
            eos_token_ids=tuple(info.eos_token_ids),
        )
        self.epoch = epoch
        self._member = member  # the executor's current membership record (None once it left)
        self._drain_rung = False  # its executor rang the ``drain`` doorbell: draining, whatever the record said
        self.executor_timeout = executor_timeout
        self.step_log = step_log
        self.channel = channel  # for the Steps stream (async scheduling)
        # Plan a step ahead when asked to and the executor can (a channel to open its stream on).
        self.pipelined = async_scheduling and channel is not None and info.pipelined
        self.moves = moves or MoveConfig()  # --migration, --peer-prefix, --rebalance (loops/moves.py)
        self.mover = Mover(self.executor, epoch, info.block_size, self.moves, info.role or "mixed")
        self._in_flight: list[str] = []  # requests of the plan whose result failed
        self._published: placement.PoolView | None = None
        self._step_id = 0
        self._pools = 1  # serving pools as this loop's last look saw them (how deep the next looks)
        self.idle_block_ms: int | None = IDLE_BLOCK_MS  # how long an idle step waits for the doorbell
        self.metrics = metrics
        self.model = info.model
        self.role = info.role or "mixed"  # its executor's --role (core/disagg.py)
        self.placements = Placements(self.executor, info.model, metrics, tracer)
        self.log = logs.for_executor(log, self.executor)
        self.s: Session

    def member(self) -> Member | None:
        """The executor's membership record as the manager last read it; draining as soon as the executor
        rang the ``drain`` doorbell (the manager reads membership once a tick)."""
        m = self._member()
        if m is not None and m.serving and self._drain_rung:
            return replace(m, state=DRAINING)
        return m

    async def lead(self, stop: asyncio.Event) -> str:
        """Step the executor until ``stop``; returns why it ended: stopped, fenced or lost."""
        if self.metrics is not None:
            self.metrics.lead(self.model, self.executor)
        try:
            return await self._lead(stop)
        finally:
            if self.metrics is not None:
                self.metrics.forget(self.model, self.executor)

    async def _lead(self, stop: asyncio.Event) -> str:
        rejected: list[str] = []
        while not stop.is_set():
            try:
                await self._run(stop, rejected)
                return "stopped"
            except Fenced as exc:
                self.log.warning("executor %s: lost the lease (%s)", self.executor, exc)
                return "fenced"
            except Stale as exc:
                self.log.warning("executor %s: Redis lost writes of this loop (%s); reloading", self.executor, exc)
            except ExecutorLost as exc:
                requeued = await self.store.reap(self.executor)
                self.log.error("executor %s lost (%s): %d requests go back to the queue", self.executor, exc, requeued)
                return "lost"
            except grpc.aio.AioRpcError as exc:
                # ABORTED: another caller's plan ran on the executor since ours (a plan of this loop's
                # own, after a failure the loop did not see, or a newer leader's); the reload finds out.
                # FAILED_PRECONDITION (a table the executor lacks, or a newer epoch there) heals
                # here: the reload starts a fresh PlanBuilder, which sends every table in full.
                self.log.warning(
                    "executor %s refused a plan (%s: %s); reloading", self.executor, exc.code().name, exc.details()
                )
                rejected = self._in_flight if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else []
            except UNAVAILABLE as exc:
                self.log.warning("redis unavailable (%s); retrying", exc)
                await _sleep(stop, RETRY_S)
            finally:
                self._close()
        return "stopped"

    def _close(self) -> None:
        """End this session's channel: the executor drops the plans still queued on it."""
        if hasattr(self, "s") and self.s.channel is not None:
            self.s.channel.close()
            self.s.channel = None

    async def start(self, rejected: list[str] | None = None) -> None:
        """Restore from the last commit; requests whose plan the executor rejected are aborted."""
        cursor = await self.store.tail_incoming()  # before loading: nothing after the load is missed
        snap = await self.store.load(self.executor)
        applied = (await self.stub.Info(pb.InfoRequest(omit_tokenizer_files=True), timeout=10)).applied_seq
        info = self.info
        totals = (info.num_gpu_blocks, info.num_cpu_blocks, info.num_disk_blocks)
        writer = CommitWriter(self.store.keys, self.executor, self.config.policy, self.store.result_ttl)
        # What Redis holds, before the restore changes anything (a cancelled completion hands its
        # prompt blocks to a mate: that mate's table must be written).
        writer.saw([r for r, _ in snap.requests])
        restored = restore(snap, totals, self.config, info.block_size, applied)
        sched = restored.sched
        for rid in rejected or []:
            if sched.finish(rid, Finish.ABORT) is not None:
                self.log.error("aborting %s: the executor rejected its step", rid)
        ops = writer.reset_ops(totals, info.block_size, max(applied, snap.seq)) if restored.reset else []
        if snap.lent and not restored.reset:  # freed by the restore: this leader lends nothing yet
            ops.append(["DEL", self.store.keys.executor(self.executor).lent])
        if snap.moving:  # the moves it named ran (else the pool was reset)
            ops.append(writer.moving(0))
        if restored.reset and snap.requests:
            self.log.warning(
                "executor %s: pool state unusable (the executor ran plans up to write %d, Redis has %d); "
                "%d requests recompute",
                self.executor,
                applied,
                snap.seq,
                len(snap.requests),
            )
        self._published = None
        ops += writer.ops(sched.take_record(), sched.blocks.is_free, self._view(sched))
        seq = await self.store.apply(self.executor, self.epoch, snap.seq, ops)
        self.log.info(
            "executor %s: restored %d live requests; device blocks free %d/%d",
            self.executor,
            len(sched.requests),
            sched.blocks.num_free(DEVICE),
            sched.blocks.total(DEVICE),
        )
        self._close()
        self.s = Session(
            sched,
            writer,
            PlanBuilder(self.epoch, self.executor),
            cursor,
            seq,
            pipe=Pipeline(2 if self.pipelined else 1, seq),
            channel=self._open(),
            hello=bool(snap.lent) or restored.reset,
        )

    def _open(self) -> UnaryChannel | StreamChannel:
        if self.pipelined:
            assert self.channel is not None
            return StreamChannel(self.channel, self.executor_timeout)
        return UnaryChannel(self.stub, self.executor_timeout)

    def _pool_view(self, sched: Scheduler, serving: bool) -> placement.PoolView:
        """This pool as placement sees it: the scheduler's view, and with LoRA the adapters the executor's
        device slots hold (its membership record, as of its last heartbeat)."""
        view = sched.view(self.executor, serving, self.role)
        m = self.member()
        if view.max_loras and m is not None and m.lora_resident:
            view = replace(view, loaded=tuple(sorted(m.lora_resident)))
        return view

    def _view(self, sched: Scheduler) -> placement.PoolView | None:
        """This pool's view if it changed since it was last published."""
        m = self.member()
        view = self._pool_view(sched, m is not None and m.serving)
        if view == self._published:
            return None
        self._published = view
        if self.metrics is not None:
            pending = sum(max(0, len(r.prompt_ids) - r.num_computed) for r in sched.requests.values())
            self.metrics.pool(self.model, self.executor, view, pending)
            if view.max_loras:
                running = [r.lora.name for r in sched.running if r.lora is not None]
                waiting = [r.lora.name for r in [*sched.waiting, *sched.swapped] if r.lora is not None]
                self.metrics.loras(self.model, self.executor, view.max_loras, running, waiting)
        return view

    async def _claim(
        self, sched: Scheduler, timer: steplog.Timer, queued: int
    ) -> tuple[list, bool, dict[str, placement.Candidate]]:
        """Claim what placement gives this executor; also whether some were lost to other loops, and the
        claimed requests' candidates (their prefix hits on each executor). ``queued``: the queue's length
        as this turn read it (none: nothing to look at; one queued since is seen next turn)."""
        seats, tokens = sched.room()
        if seats <= 0 or tokens <= 0 or queued <= 0:
            return [], False, {}
        candidates, views = await timer.redis_call(self.store.look(placement.peek_depth(seats, self._pools)))
        self._pools = sum(v.serving for v in views.values())
        if not candidates:
            return [], False, {}
        views[self.executor] = self._pool_view(sched, True)
        picks = placement.pick(
            candidates,
            self.executor,
            views,
            policy=self.config.policy,
            seats=seats,
            budget=tokens,
            disagg=self.moves.disagg,
        )
        self.log.debug(
            "executor %s: %d queued, views %s, picks %s",
            self.executor,
            len(candidates),
            views,
            [c.request_id for c in picks],
        )
        if not picks:
            return [], False, {}
        claimed = await timer.redis_call(
            self.store.claim(self.executor, self.epoch, self.s.seq, [c.queue_key for c in picks])
        )
        self.s.seq += 1
        self.placements.claimed(claimed)
        return [(c.req, c.cancel) for c in claimed], len(claimed) < len(picks), {c.request_id: c for c in picks}

    async def _run(self, stop: asyncio.Event, rejected: list[str]) -> None:
        await self.start(rejected)
        rejected.clear()
        while not stop.is_set():
            if not await self.iterate():
                return  # the executor left the membership: the manager reaps it

    async def iterate(self) -> bool:
        """One turn: (pipelined: take the oldest result, reading the doorbell meanwhile; else read it)
        cancels, claims, schedule and send a plan, (serial: take its result,) commit. False once the
        executor left."""
        s, timer = self.s, self.s.timer
        member = self.member()
        if member is None:
            return False
        sched = s.sched
        timer.start()
        if s.pipe.wait_first():
            done, (ops_in, queued) = await self._complete_and_read()
        else:
            block = None if sched.has_work or s.retry or s.pipe else self.idle_block_ms
            done, (ops_in, queued) = None, await timer.redis_call(self.store.read_incoming(s.cursor, block))
        if ops_in:
            s.cursor = ops_in[-1].stream_id
        if any(o.op == "drain" and o.request_id == self.executor for o in ops_in) and member.serving:
            self._drain_rung = True
            member = self.member() or member
        cancels = [(o.request_id, o.reason) for o in ops_in if o.op == "cancel" and o.reason is not None]
        claimed: list[tuple[Request, Finish | None]] = []
        s.retry, hold = False, False
        candidates: dict[str, placement.Candidate] = {}
        self.mover.doorbells(sched, ops_in, member)
        views = await timer.redis_call(self.store.views()) if self.mover.wants_views(sched, member) else None
        if not member.serving:
            hold = self._drain(sched, member, views or {})
        else:
            claimed, s.retry, candidates = await self._claim(sched, timer, queued)
            hold = self.mover.serve(sched, member, views, bool(s.pipe))
        intake(sched, claimed, [(rid, r) for rid, r in cancels if rid in sched.requests])
        self.mover.ask(sched, [r for r, cancel in claimed if cancel is None], candidates)
        sched.expire(now_ms())  # queue deadlines: nothing past its own starts now
        # Pipelined, what the result changed is taken before planning: a plan that swaps holds back the commits
        # made while it is in flight with another (flights.py), and the result's tokens then go out alone.
        news = [self._written(sched, view=False)] if done is not None and s.pipe and s.pipe.can_commit() else []
        launched = None
        if not hold and s.pipe.can_launch(bool(s.pipe) and sched.wants_drafts()) and (sched.has_work or s.hello):
            launched = self._launch(sched.schedule())
        if done is None and s.pipe.wait_after(launched is not None):
            done = await self._complete()
            if s.pipe.launch_again(launched is not None) and not hold and s.pipe.can_launch() and sched.has_work:
                launched = self._launch(sched.schedule())  # before the commit: the executor waits only for this
        sched.expire(now_ms())  # what would go back to the queue (or stays swapped) past its deadline ends here
        sched.requeue_waiting(now_ms())
        if s.pipe.can_commit():
            await self._commit(*news, self._written(sched))
        elif news:
            await self._commit(*news)
        timer.stop()
        if self.step_log is not None and done is not None:
            self._log_step(sched, done, queued, timer)
        return True

    def _drain(self, sched: Scheduler, member: Member, views: dict[str, placement.PoolView]) -> bool:
        """A draining executor's turn: move what peers have room for now (``--migration``: with its KV,
        pre-copied, or by recompute; loops/moves.py), and from ``evacuate_at_ms`` everything left by
        recompute. Requests leave with nothing in flight; returns whether to hold plans until that is so."""
        if self.mover.drain(sched, member, views, bool(self.s.pipe)):
            return True
        if member.evacuate_at_ms and now_ms() >= member.evacuate_at_ms and sched.requests:
            if self.s.pipe:
                return True  # requests leave with nothing in flight: first take what is
            self.log.warning(
                "executor %s: drain deadline; moving %d requests elsewhere", self.executor, len(sched.requests)
            )
            sched.evacuate()
        return False

    def _launch(self, out: SchedulerOutput) -> Flight | None:
        """Build ``out``'s plan, count its tokens as computed (``Scheduler.launch``) and send it."""
        s, timer = self.s, self.s.timer
        if not out.has_work and not s.hello:
            return None
        s.hello = False
        t = time.perf_counter()
        plan = s.plans.build(out, self._step_id, s.ended, s.seq)
        s.sched.launch(out)
        timer.plan = timer.since(t)
        s.ended = []
        flight = Flight.of(out, self._step_id, s.seq)
        assert s.channel is not None
        timer.encode = s.channel.send(plan)
        s.pipe.add(flight)
        self._step_id += 1
        return flight

    async def _complete_and_read(self) -> tuple[tuple[Flight, pb.StepResult], tuple[list, int]]:
        """The oldest result, with the doorbell read while it is awaited: the executor already runs the
        next plan, so a round trip to Redis after the result would only delay the plan after it. The
        step log counts as Redis time only what is left of the read once the result is in."""
        read = asyncio.ensure_future(self.store.read_incoming(self.s.cursor, None))
        try:
            done = await self._complete()
        except BaseException:
            read.cancel()
            if read.done() and not read.cancelled():
                read.exception()  # the result's failure is the one handled; the read's is dropped
            raise
        return done, await self.s.timer.redis_call(read)

    async def _complete(self) -> tuple[Flight, pb.StepResult]:
        """Wait for the oldest plan's result and apply it."""
        s, timer = self.s, self.s.timer
        flight = s.pipe.flights[0]
        t = time.perf_counter()
        result = await self._result()
        timer.executor = timer.since(t) - timer.decode
        s.pipe.flights.popleft()
        s.sched.update(flight.out, *outputs(result), pulled=pulls_of(result))
        costs = s.sched.moves.costs
        costs.stepped(flight.out.num_tokens, result.forward_ms)
        costs.copied(len(flight.out.swap_in) + len(flight.out.swap_out) + len(flight.out.copies), result.copy_ms)
        s.sched.observe_step(flight.out, result.step_ms, result.idle_ms)
        self.placements.stepped(flight.out)
        if self.metrics is not None:
            self.metrics.step(self.model, self.executor, flight.out.num_tokens)
        return flight, result

    def _written(self, sched: Scheduler, view: bool = True) -> Written:
        """Everything recorded since the last commit, taken, as the commands of a commit; for the requests of
        a plan still in flight only what the reported steps computed. ``view``: with this pool's usage."""
        s = self.s
        rec = sched.take_record()
        s.ended += [r.request_id for r in rec.finished] + [r.request_id for r in rec.requeued]
        t = time.perf_counter()
        starts = s.pipe.starts(sched.requests) if s.pipe else None
        ops = s.writer.ops(rec, sched.blocks.is_free, self._view(sched) if view else None, starts)
        if (moving := s.pipe.moving()) != s.moving:
            s.moving = moving
            ops.append(s.writer.moving(moving))
        s.timer.commit += s.timer.since(t)
        return rec, ops

    async def _commit(self, *parts: Written) -> None:
        """One fenced call for ``parts``, in order."""
        s, timer = self.s, self.s.timer
        ops = [op for _, part in parts for op in part]
        left_ns = time.time_ns()
        if ops:
            s.seq = await timer.redis_call(self.store.apply(self.executor, self.epoch, s.seq, ops))
        for rec, _ in parts:
            self.placements.left(rec, left_ns)
            if self.metrics is not None:
                self.metrics.committed(self.model, self.executor, rec)

    async def _result(self) -> pb.StepResult:
        assert self.s.channel is not None
        try:
            result, self.s.timer.decode = await self.s.channel.result()
            return result
        except grpc.aio.AioRpcError as exc:
            self._in_flight = list(self.s.pipe.flights[0].starts)  # the refused plan: the oldest
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT or await self._same_instance():
                raise  # the plan was refused, or a passing fault: reload and resend
            raise ExecutorLost(f"Step failed: {exc.code().name}: {exc.details()}") from exc

    async def _same_instance(self) -> bool:
        """Whether the executor still answers as the instance this loop leads, with a working engine."""
        try:
            info = await self.stub.Info(pb.InfoRequest(omit_tokenizer_files=True), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return info.instance_id == self.executor and info.state != "failed"

    def _log_step(
        self, sched: Scheduler, done: tuple[Flight, pb.StepResult], queued: int, timer: steplog.Timer
    ) -> None:
        assert self.step_log is not None
        steplog.write(self.step_log, steplog.stats(self.executor, sched, *done, queued, timer, len(self.s.pipe)))


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
