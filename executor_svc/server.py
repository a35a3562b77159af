"""Thin gRPC servicer: protobuf in, one Engine call, protobuf out.

``add_to_server`` registers it taking each request as bytes and parsing it in
the handler, so that bytes that are no plan get INVALID_ARGUMENT, not grpcio's
UNKNOWN.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace

import grpc

from executor_svc.block_tables import UnknownTable
from executor_svc.engine import Engine
from executor_svc.lifecycle import Lifecycle
from executor_svc.logprobs import Entry
from executor_svc.metrics import ExecutorMetrics
from executor_svc.plan import LoraRef, PlanError, SeqInput, StepInput, StepOutput
from executor_svc.runner import PlanRunner, TorchThread, UnknownSample
from executor_svc.sampler import Sampling
from executor_svc.transfer import LendError, Lends, Puller, chunks, refs
from pagedserve import handlers
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.members import Member
from pagedserve.tiers import BlockMove, Tier

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


def _moves(moves: Iterable[pb.BlockMove]) -> list[BlockMove]:
    return [BlockMove(Tier(m.src_tier), m.src, Tier(m.dst_tier), m.dst) for m in moves]


def sampling_from_pb(s: pb.Sampling, eos: list[int]) -> Sampling:
    m = s.min_tokens
    return Sampling(
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        min_tokens=m.count,
        min_tokens_ids=tuple(m.stop_token_ids) + (tuple(eos) if m.include_eos else ()) if m.count else (),
        logit_bias=tuple(sorted(s.logit_bias.items())),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        allowed_token_ids=tuple(s.allowed_token_ids),
        bad_words=tuple(tuple(w.token_ids) for w in s.bad_words),
    )


def _seq_from_pb(s: pb.SeqPlan, eos: list[int]) -> SeqInput:
    seq = SeqInput(
        request_id=s.request_id,
        token_ids=list(s.token_ids),
        start_pos=s.start_pos,
        block_table=list(s.block_table),
        sampling=sampling_from_pb(s.sampling, eos),
        sample=s.sample,
        num_generated=s.num_generated,
        full_table=s.full_table,
        history=list(s.history) if s.history else None,
        grammar=(s.sampling.grammar.kind, s.sampling.grammar.spec) if s.sampling.grammar.kind else None,
        from_last_sample=s.from_last_sample,
        lora=LoraRef(s.lora.digest, s.lora.path, s.lora.name) if s.HasField("lora") else None,
        drafts=list(s.draft_token_ids),
    )
    if s.sampling.HasField("prompt_logprobs"):
        plp = s.sampling.prompt_logprobs
        seq.prompt_logprobs = plp.top
        seq.prompt_next = plp.next_token if plp.HasField("next_token") else None
    return seq


def plan_from_pb(plan: pb.StepPlan, eos: list[int] | None = None) -> StepInput:
    """``eos``: the model's EOS ids, which ``min_tokens`` masks when the request asks."""
    return StepInput(
        step_id=plan.step_id,
        swap_out=_moves(plan.swap_out),
        swap_in=_moves(plan.swap_in),
        copies=_moves(plan.copies),
        seqs=[_seq_from_pb(s, eos or []) for s in plan.seqs],
        forget=list(plan.forget),
        reset_tables=plan.reset_tables,
    )


def _logprobs_pb(e: Entry) -> pb.Logprobs:
    return pb.Logprobs(
        token_id=e.token_id, logprob=e.logprob, rank=e.rank, top_ids=e.top_ids, top_logprobs=e.top_logprobs
    )


def _outputs(out: StepOutput) -> list[pb.SeqOutput]:
    outputs = []
    prompt = dict(out.prompt_logprobs)
    for rid, t in out.tokens:
        o = pb.SeqOutput(request_id=rid, token_id=t)
        if rid in out.more:
            o.more_token_ids.extend(out.more[rid])
            o.more_logprobs.extend(_logprobs_pb(e) for e in out.more_logprobs.get(rid, ()))
        if rid in out.logprobs:
            o.logprobs.CopyFrom(_logprobs_pb(out.logprobs[rid]))
        if rid in prompt:
            o.prompt_start, entries = prompt.pop(rid)
            o.prompt_logprobs.extend(_logprobs_pb(e) for e in entries)
        outputs.append(o)
    for rid, (start, entries) in prompt.items():  # prompt chunks that sampled nothing
        outputs.append(
            pb.SeqOutput(
                request_id=rid, no_token=True, prompt_start=start, prompt_logprobs=[_logprobs_pb(e) for e in entries]
            )
        )
    return outputs


def result_to_pb(out: StepOutput) -> pb.StepResult:
    return pb.StepResult(
        step_id=out.step_id,
        outputs=_outputs(out),
        swapped_out=out.swapped_out,
        swapped_in=out.swapped_in,
        forward_ms=out.forward_ms,
        step_ms=out.step_ms,
        copy_ms=out.swap_in_ms + out.swap_out_ms,
    )


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(
        self,
        engine: Engine,
        lifecycle: Lifecycle | None = None,
        metrics: ExecutorMetrics | None = None,
        puller: Puller | None = None,
        read_delay_s: float = 0.0,
        role: str = "mixed",
        torch_thread: TorchThread | None = None,
    ) -> None:
        self.engine = engine
        self.torch = torch_thread or TorchThread()  # where steps run: the thread that built the engine (runner.py)
        self.role = role  # --role: what its schedulers give it (pagedserve.members.ROLES)
        self.read_delay_s = read_delay_s  # --read-blocks-delay-ms: fault injection (transfer.chunks)
        self.lends = Lends()  # blocks this executor's loop lent to peers (executor_svc/transfer.py)
        self.puller = puller  # None: pulls from peers fail (no way to dial them), and recompute
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
            model_path=str(e.cfg.model.absolute()),
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
            role=self.role,
        )

    def member(self, address: str) -> Member:
        member = Member.from_info(self.info(with_tokenizer=False), address)
        if (adapters := self.engine.adapters) is None:
            return member
        return replace(
            member,
            lora_slots=len(adapters.slots),
            lora_resident=tuple(adapters.resident()),
            lora_cached=tuple(adapters.cached()),
        )

    def renew_instance(self) -> str:
        self._epoch = self._applied_seq = 0
        self.lends.clear()
        return self.engine.renew_instance()

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        if request.renew_instance:
            async with self.runner.lock:
                log.warning("a scheduler evicted instance %s; now %s", self.engine.instance_id, self.renew_instance())
        return self.info(with_tokenizer=not request.omit_tokenizer_files)

    async def Step(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        return await self.runner.one(request, context)

    async def Steps(
        self, requests: AsyncIterator[pb.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        async for result in self.runner.stream(requests, context):
            yield result

    async def _run(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        """The fences, then the step (the runner holds the lock)."""
        plan = plan_from_pb(request, self.engine.eos_token_ids)
        self.last_step = asyncio.get_running_loop().time()
        if request.instance_id and request.instance_id != self.engine.instance_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"instance_id: this executor is {self.engine.instance_id}, not {request.instance_id}",
            )
        if request.epoch < self._epoch:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"epoch: {request.epoch} is stale; a loop with epoch {self._epoch} leads",
            )
        if request.seq < self._applied_seq:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"seq: {request.seq} is behind plans already executed (up to "
                f"{self._applied_seq}): Redis lost writes; recompute",
            )
        self._applied_seq = request.seq
        if self.lifecycle.state == "failed":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine failed; this executor is leaving")
        self._epoch = request.epoch
        self._lend(request)
        pulls = [asyncio.ensure_future(self._pull(p)) for p in request.pulls]  # beside the forward pass
        try:
            # The forward pass holds the GIL-free torch kernels; a thread keeps health checks answering.
            out = await self.torch.run(self.engine.step, plan)
        except UnknownTable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no block table for {exc}; send it in full")
        except UnknownSample as exc:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"no sampled token for {exc} to continue from; send its tokens"
            )
        except PlanError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception:
            log.exception("the engine failed; reporting NOT_SERVING and leaving the namespace")
            self.lifecycle.fail()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine failed; this executor is leaving")
        finally:
            pulled = await asyncio.gather(*pulls)  # a plan's pulls are done when its result (or error) is
        if self.metrics is not None:
            self.metrics.observe(out, bool(plan.swap_in or plan.copies), bool(plan.swap_out))
            self.metrics.pulled(pulled)
        result = result_to_pb(out)
        result.pulls.extend(pulled)
        return result

    def _lend(self, plan: pb.StepPlan) -> None:
        """A plan's lend changes, before anything else of it (a reset ends every lend: a new leader
        does not know which reads its predecessor's lends still serve)."""
        if plan.reset_tables:
            self.lends.clear()
        for lend_id in plan.unlends:
            self.lends.unlend(lend_id)
        for lend in plan.lends:
            self.lends.lend(lend.lend_id, refs(lend.blocks))

    async def _pull(self, p: pb.Pull) -> pb.PullResult:
        if self.puller is None:
            return pb.PullResult(request_id=p.request_id, ok=False, error="this executor cannot dial peers")
        return await self.puller.pull(self.engine.pool, p)

    async def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.BlockChunk]:
        """Stream blocks of a live lend to a peer (executor_svc/transfer.py)."""
        blocks = refs(request.blocks)

        def still_lent() -> None:
            if request.instance_id != self.engine.instance_id:
                raise LendError(f"instance_id: this executor is {self.engine.instance_id}, not {request.instance_id}")
            if request.epoch < self._epoch:
                raise LendError(f"epoch: {request.epoch} is stale; a loop with epoch {self._epoch} leads")
            self.lends.check(request.lend_id, blocks)

        try:
            async for chunk in chunks(self.engine.pool, blocks, still_lent, self.read_delay_s):
                yield chunk
        except LendError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


def add_to_server(servicer: ExecutorServicer, server: grpc.aio.Server) -> None:
    """Register the Executor service, parsing requests in the handlers (in place of
    ``executor_pb2_grpc.add_ExecutorServicer_to_server``; same names, same messages).
    The server's receive limit bounds their size."""
    handlers.register(
        server,
        pb.DESCRIPTOR.services_by_name["Executor"],
        {
            "Info": handlers.unary(servicer.Info, pb.InfoRequest),
            "Step": handlers.unary(servicer.Step, pb.StepPlan),
            "Steps": handlers.bidi(servicer.Steps, pb.StepPlan),
            "ReadBlocks": handlers.stream(servicer.ReadBlocks, pb.ReadBlocksRequest),
        },
    )
