"""``executor_svc.runner.PlanRunner`` over real gRPC (a local server), with a stand-in for the
engine that records which plans ran: it isolates the ordering and dropping rules of the ``Steps``
stream from the model."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from executor_svc.runner import PlanRunner, TorchThread
from pagedserve import handlers
from pagedserve.executor.v1 import executor_pb2 as pb

METHOD = "/pagedserve.executor.v1.Executor/Steps"


class Recorder:
    """Runs a plan in ``delay`` seconds; refuses plan ids in ``refuse`` with INVALID_ARGUMENT."""

    def __init__(self, delay: float = 0.05, refuse: tuple[int, ...] = ()) -> None:
        self.ran: list[int] = []
        self.delay = delay
        self.refuse = refuse
        self.runner = PlanRunner(self.run)

    async def run(self, plan: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        if plan.step_id in self.refuse:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan {plan.step_id} refused")
        await asyncio.sleep(self.delay)
        self.ran.append(plan.step_id)
        return pb.StepResult(step_id=plan.step_id)

    async def Step(self, plan: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        return await self.runner.one(plan, context)

    async def Steps(self, plans, context):  # type: ignore[no-untyped-def]
        async for result in self.runner.stream(plans, context):
            yield result


async def serve(rec: Recorder) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = grpc.aio.server()
    handlers.register(
        server,
        pb.DESCRIPTOR.services_by_name["Executor"],
        {
            "Info": handlers.unary(rec.Step, pb.InfoRequest),  # unused here
            "Step": handlers.unary(rec.Step, pb.StepPlan),
            "Steps": handlers.bidi(rec.Steps, pb.StepPlan),
            "ReadBlocks": handlers.stream(rec.Steps, pb.ReadBlocksRequest),  # unused here
        },
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def open_stream(ch: grpc.aio.Channel) -> tuple[asyncio.Queue, grpc.aio.StreamStreamCall]:
    queue: asyncio.Queue = asyncio.Queue()

    async def plans():  # type: ignore[no-untyped-def]
        while (plan := await queue.get()) is not None:
            yield plan

    call = ch.stream_stream(
        METHOD, request_serializer=pb.StepPlan.SerializeToString, response_deserializer=pb.StepResult.FromString
    )(plans(), timeout=30)
    return queue, call


def test_plans_run_in_order_and_a_failure_drops_the_queued_ones() -> None:
    async def go() -> None:
        rec = Recorder(refuse=(2,))
        server, ch = await serve(rec)
        try:
            queue, call = open_stream(ch)
            for i in (1, 2, 3, 4):  # all queued before the first ends
                queue.put_nowait(pb.StepPlan(step_id=i))
            assert (await call.read()).step_id == 1
            try:
                await call.read()
                raise AssertionError("plan 2 was refused")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            await asyncio.sleep(0.3)
            assert rec.ran == [1], "plans queued behind the refused one never run"
        finally:
            await ch.close()
            await server.stop(None)

    asyncio.run(go())


def test_a_newer_caller_supersedes_a_stream() -> None:
    async def go() -> None:
        rec = Recorder(delay=0.0)
        server, ch = await serve(rec)
        try:
            old, old_call = open_stream(ch)
            old.put_nowait(pb.StepPlan(step_id=1))
            assert (await old_call.read()).step_id == 1
            new, new_call = open_stream(ch)
            new.put_nowait(pb.StepPlan(step_id=10))
            assert (await new_call.read()).step_id == 10
            old.put_nowait(pb.StepPlan(step_id=2))
            try:
                await old_call.read()
                raise AssertionError("the old stream was superseded")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.ABORTED
            new.put_nowait(pb.StepPlan(step_id=11))
            result = await new_call.read()
            assert (result.step_id, rec.ran) == (11, [1, 10, 11])
            assert result.idle_ms >= 0.0
        finally:
            await ch.close()
            await server.stop(None)

    asyncio.run(go())


def test_the_next_plan_runs_while_a_result_is_still_being_written() -> None:
    """Driven without gRPC: the stream's consumer (the call's writer) takes the first result and
    then stalls, as a slow write would; the plan queued behind it runs anyway."""

    async def go() -> None:
        rec = Recorder(delay=0.01)

        async def plans():  # type: ignore[no-untyped-def]
            for i in (1, 2, 3):
                yield pb.StepPlan(step_id=i)
            await asyncio.sleep(10)  # the stream stays open

        results = rec.runner.stream(plans(), context=None)  # type: ignore[arg-type]
        assert (await results.__anext__()).step_id == 1
        await asyncio.sleep(0.2)  # nothing asks for the next result meanwhile
        assert rec.ran == [1, 2, 3]
        assert [(await results.__anext__()).step_id for _ in range(2)] == [2, 3]
        await results.aclose()

    asyncio.run(go())


def test_the_torch_thread_runs_everything_on_one_thread_and_a_cancelled_call_waits() -> None:
    """``TorchThread`` (plain callables, no torch: what it isolates is the threading). Start-up work (``call``) and
    every step (``run``) land on one thread, not the event loop's; a caller cancelled mid-call gets its cancellation
    only after the callable has ended, so the engine's lock is held until the engine is free."""
    worker = TorchThread()
    built_on = worker.call(threading.get_ident)
    ended: list[float] = []

    def slow() -> None:
        time.sleep(0.2)
        ended.append(time.monotonic())

    async def go() -> tuple[list[int], float]:
        ran_on = [await worker.run(threading.get_ident) for _ in range(3)]
        task = asyncio.ensure_future(worker.run(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return ran_on, time.monotonic()
        raise AssertionError("the cancellation was swallowed")

    ran_on, cancelled_at = asyncio.run(go())
    assert built_on != threading.get_ident()
    assert ran_on == [built_on] * 3
    assert ended and cancelled_at >= ended[0], "the cancellation came before the callable ended"
