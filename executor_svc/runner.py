"""The executor's side of the pipelined step loop (torch-free: the stub executor uses it too).

A pipelined scheduler sends plan N+1 while the executor still runs plan N, on
one ``Steps`` stream; ``PlanRunner`` runs the plans of that stream back to back,
in order, one at a time (the pool is not reentrant), in a task of their own: a
step starts as soon as the previous one ends, while that one's result is still
being written to the stream (a refusal is sent after the results before it,
``Refusal``). A plan that fails ends the stream, and the plans queued behind it
are dropped, never run: they were built on a result that did not come. The same
holds for a stream that a newer stream (or a unary ``Step``) superseded: once
another caller's plan ran, the older stream's queued plans end with ABORTED, so
after any failure only plans of the scheduler's fresh stream touch the KV.

Plan N+1 is built before step N's tokens are known, so a decoding sequence's
input may be "the token sampled for this request in the previous step"
(``SeqPlan.from_last_sample``); ``LastSampled`` remembers those tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from pagedserve.executor.v1 import executor_pb2 as pb

T = TypeVar("T")
RunPlan = Callable[[pb.StepPlan, grpc.aio.ServicerContext], Awaitable[pb.StepResult]]


class UnknownSample(LookupError):
    """A plan continues from a sampled token this executor does not have (it restarted, or forgot
    the request): the scheduler must reload and send the tokens themselves."""


class LastSampled:
    """request id -> the token this executor sampled for it in its latest step."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}

    def resolve(self, seqs: list[Any]) -> None:
        """Put the sampled token in place of each ``from_last_sample`` reference (``SeqInput``s,
        changed in place): from here on it is that step's input like any other token."""
        for s in seqs:
            if s.from_last_sample:
                token = self._tokens.get(s.request_id)
                if token is None:
                    raise UnknownSample(s.request_id)
                s.token_ids.append(token)
                s.from_last_sample = False

    def record(self, tokens: list[tuple[str, int]]) -> None:
        self._tokens.update(tokens)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def clear(self) -> None:
        self._tokens.clear()

    def __len__(self) -> int:
        return len(self._tokens)


class TorchThread:
    """The one thread that runs this process's torch work: the engine is built on it and every step runs on it.

    libgomp (torch's OpenMP) gives each thread that starts a parallel region a team of its own, and once its
    threads outnumber the cores, a thread waiting at a barrier spins ~100 rounds instead of ~300,000 before it sleeps
    on a futex: each of a step's hundreds of parallel regions (every GEMM, the attention kernel) then waits for a
    wake-up. Steps run from a pool of threads other than the one that loaded the model (``asyncio.to_thread``) took
    1.3-1.4x as long (SmolLM2 on 2 cores: 27 against 19 ms at 1 row, 69 against 54 at 32); built and run on one
    thread, the engine steps at its speed alone. The event loop's own torch work (copying blocks for a peer) runs on
    one OpenMP thread (``torch.set_num_threads(1)`` there) and so starts no team.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, waited for (start-up, before the event loop serves)."""
        return self._pool.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread; if the caller is cancelled (its client went away), wait for it to end
        before passing the cancellation on, so that whoever holds the engine's lock keeps it until the engine is
        really free."""
        task = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            raise


class Refusal(Exception):
    """A plan's abort, raised where it was refused and sent on the stream after the results before it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _Ahead:
    """The stream's context for plans run ahead of its writes: ``abort`` raises a ``Refusal``
    instead of ending the call at once, which would drop results not written yet."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> None:
        raise Refusal(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class PlanRunner:
    """Runs plans one at a time, in arrival order, from unary calls and ``Steps`` streams."""

    def __init__(self, run: RunPlan) -> None:
        self._run = run  # the fences and the step itself; aborts the call on a refusal
        self.lock = asyncio.Lock()
        self._owner: object | None = None  # the caller whose plan ran last
        self._last_end: float | None = None  # perf_counter() when the latest step ended

    async def one(self, plan: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        return await self._locked(plan, context, object(), False)

    async def stream(
        self, plans: AsyncIterator[pb.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        """One result per plan, in order. Plans are read (and queued) while earlier ones run, and run
        in a task of their own: the next step starts as soon as the last one ends, while its result
        is still being written to the stream (the device never waits for gRPC)."""
        me = object()
        queue: asyncio.Queue[pb.StepPlan | None] = asyncio.Queue()
        results: asyncio.Queue[pb.StepResult | BaseException | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for plan in plans:
                    queue.put_nowait(plan)
            finally:
                queue.put_nowait(None)

        async def run() -> None:
            started, ahead = False, _Ahead(context)
            try:
                while (plan := await queue.get()) is not None:
                    results.put_nowait(await self._locked(plan, ahead, me, started))
                    started = True
                results.put_nowait(None)
            except Exception as exc:  # a refusal or a failed step: the stream ends after the results before it
                results.put_nowait(exc)

        reader, runner = asyncio.create_task(read()), asyncio.create_task(run())
        try:
            while (item := await results.get()) is not None:
                if isinstance(item, Refusal):
                    await context.abort(item.code, item.details)
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # whatever is still queued is dropped with the stream
            reader.cancel()
            runner.cancel()

    async def _locked(self, plan: pb.StepPlan, context: Any, me: object, started: bool) -> pb.StepResult:
        async with self.lock:
            if started and self._owner is not me:
                await context.abort(
                    grpc.StatusCode.ABORTED, "superseded: another caller's plan ran since this stream's last one"
                )
            t0 = time.perf_counter()
            result = await self._run(plan, context)
            self._owner = me
            result.idle_ms = 0.0 if self._last_end is None else max(0.0, (t0 - self._last_end) * 1e3)
            self._last_end = time.perf_counter()
            return result
