"""Thin gRPC servicer: protobuf in, one Engine call, protobuf out.

``add_to_server`` registers it taking each request as bytes and parsing it in
the handler, so that bytes that are no plan get INVALID_ARGUMENT, not grpcio's
UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from executor_svc.block_tables import UnknownTable
from executor_svc.engine import Engine, Move, PlanError, SeqInput, StepInput, StepOutput
from executor_svc.lifecycle import Lifecycle
from executor_svc.metrics import ExecutorMetrics
from executor_svc.pipeline import PlanRunner, UnknownSample, in_thread
from executor_svc.sampler import SamplingParams
from pagedserve import handlers
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.members import Member

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


def _moves(moves: object) -> list[Move]:
    return [Move(m.src_tier, m.src, m.dst_tier, m.dst) for m in moves]


def plan_from_pb(plan: pb.StepPlan) -> StepInput:
    return StepInput(
        step_id=plan.step_id,
        swap_out=_moves(plan.swap_out),
        swap_in=_moves(plan.swap_in),
        copies=_moves(plan.copies),
        seqs=[
            SeqInput(
                request_id=s.request_id,
                token_ids=list(s.token_ids),
                start_pos=s.start_pos,
                block_table=list(s.block_table),
                sampling=SamplingParams(
                    temperature=s.sampling.temperature,
                    top_p=s.sampling.top_p or 1.0,
                    top_k=s.sampling.top_k,
                    seed=s.sampling.seed if s.sampling.has_seed else None,
                ),
                sample=s.sample,
                num_generated=s.num_generated,
                full_table=s.full_table,
                from_last_sample=s.from_last_sample,
            )
            for s in plan.seqs
        ],
        forget=list(plan.forget),
        reset_tables=plan.reset_tables,
    )


def result_to_pb(out: StepOutput) -> pb.StepResult:
    return pb.StepResult(
        step_id=out.step_id,
        outputs=[pb.SeqOutput(request_id=r, token_id=t) for r, t in out.tokens],
        swapped_out=out.swapped_out,
        swapped_in=out.swapped_in,
        forward_ms=out.forward_ms,
        step_ms=out.step_ms,
    )


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, engine: Engine, lifecycle: Lifecycle | None = None,
                 metrics: ExecutorMetrics | None = None) -> None:
        self.engine = engine
        self.lifecycle = lifecycle or Lifecycle()
        self.metrics = metrics
        self.runner = PlanRunner(self._run)  # one plan at a time, in order: the pool is not reentrant
        self._epoch = 0  # the highest loop epoch seen: older plans come from deposed leaders
        self._applied_seq = 0  # the highest plan seq executed: a lower one means Redis lost writes
        self.last_step = 0.0  # event-loop time of the last plan

    def info(self, with_tokenizer: bool = True) -> pb.InfoResponse:
        e, life = self.engine, self.lifecycle
        return pb.InfoResponse(
            model=str(e.cfg.model.name),
            block_size=e.geometry.block_size,
            num_gpu_blocks=e.pool.count(0),
            num_cpu_blocks=e.pool.count(1),
            num_disk_blocks=e.pool.count(2),
            max_model_len=e.max_model_len,
            eos_token_ids=e.eos_token_ids,
            vocab_size=e.vocab_size,
            tokenizer_files=e.tokenizer_files() if with_tokenizer else {},
            device=str(e.device),
            attention_backend=e.backend.name,
            instance_id=e.instance_id,
            state=life.state,
            evacuate_at_ms=life.evacuate_at_ms,
            dtype=e.cfg.dtype,
            model_digest=e.model_digest,
            applied_seq=self._applied_seq,
            pipelined=True,
        )

    def member(self, address: str) -> Member:
        return Member.from_info(self.info(with_tokenizer=False), address)

    def renew_instance(self) -> str:
        self._epoch = self._applied_seq = 0
        return self.engine.renew_instance()

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        if request.renew_instance:
            async with self.runner.lock:
                log.warning("a scheduler evicted instance %s; now %s", self.engine.instance_id, self.renew_instance())
        return self.info(with_tokenizer=not request.omit_tokenizer_files)

    async def Step(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        return await self.runner.one(request, context)

    async def Steps(self, requests: AsyncIterator[pb.StepPlan],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResult]:
        async for result in self.runner.stream(requests, context):
            yield result

    async def _run(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        """The fences, then the step (the runner holds the lock)."""
        plan = plan_from_pb(request)
        self.last_step = asyncio.get_running_loop().time()
        if request.instance_id and request.instance_id != self.engine.instance_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"instance_id: this executor is {self.engine.instance_id}, not "
                                f"{request.instance_id}")
        if request.epoch < self._epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"epoch: {request.epoch} is stale; a loop with epoch {self._epoch} leads")
        if request.seq < self._applied_seq:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"seq: {request.seq} is behind plans already executed (up to "
                                f"{self._applied_seq}): Redis lost writes; recompute")
        self._applied_seq = request.seq
        if self.lifecycle.state == "failed":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine failed; this executor is leaving")
        self._epoch = request.epoch
        try:
            # The forward pass holds the GIL-free torch kernels; a thread keeps health checks answering.
            out = await in_thread(self.engine.step, plan)
        except UnknownTable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no block table for {exc}; send it in full")
        except UnknownSample as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no sampled token for {exc} to continue from; send its tokens")
        except PlanError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception:
            log.exception("the engine failed; reporting NOT_SERVING and leaving the namespace")
            self.lifecycle.fail()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine failed; this executor is leaving")
        if self.metrics is not None:
            self.metrics.observe(out, bool(plan.swap_in or plan.copies), bool(plan.swap_out))
        return result_to_pb(out)


def add_to_server(servicer: ExecutorServicer, server: grpc.aio.Server) -> None:
    """Register the Executor service, parsing requests in the handlers (in place of
    ``executor_pb2_grpc.add_ExecutorServicer_to_server``; same names, same messages).
    The server's receive limit bounds their size."""
    handlers.register(server, pb.DESCRIPTOR.services_by_name["Executor"], {
        "Info": handlers.unary(servicer.Info, pb.InfoRequest),
        "Step": handlers.unary(servicer.Step, pb.StepPlan),
        "Steps": handlers.bidi(servicer.Steps, pb.StepPlan),
    })
