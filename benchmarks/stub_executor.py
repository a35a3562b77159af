"""``python -m benchmarks.stub_executor``: a real ``pagedserve.executor.v1.Executor`` gRPC server with no model.

``Step`` answers with one token per sampled sequence, either at once (the
default: a scheduler driving it spends its step time on scheduling, Redis and
the gRPC round trip only, which is what the scheduler-overhead benchmark
measures) or after ``--step-ms`` of simulated forward pass (``asyncio.sleep``:
the process stays idle meanwhile, as a CPU host waiting on its GPU would), which
is what the scale-out benchmark uses. With ``--step-model A,B,C`` the simulated
step is instead modelled from the plan's shape, ``A + B x prefill tokens + C x
decode sequences`` ms (``benchmarks/disagg.py`` fits A, B and C to the real
executor's step reports): a sequence of one token that samples is a decode (its
token named by ``from_last_sample`` counts), any other sequence's tokens are
prefill tokens. ``Info`` serves the model directory's
real tokenizer files, eos ids and vocabulary size, so the scheduler's frontend
works unchanged.

KV that moves (docs/architecture.md, "KV that moves"), so that a real scheduler
drives prefill and decode stubs (``--role``) unchanged: a plan's ``lends`` and
``unlends`` (and ``reset_tables``) keep the same lend table as the real executor
(``executor_svc.transfer.Lends``), and ``ReadBlocks`` refuses a read that is not
under a live lend, of this instance, at the lending loop's epoch or newer, as the
real one does, then answers with one chunk naming the blocks and carrying no KV (a
stub has none). A plan's ``pulls`` call the source's ``ReadBlocks`` that way, then
sleep the **modelled** transfer time, ``--pull-model D,E``: ``D + E x blocks`` ms,
and report ``ok`` with the bytes the real KV would have had; they run beside the
modelled step, as the real executor's pulls run beside its forward pass, so the
step takes the longer of the two. No KV moves anywhere.

With ``--redis-url`` the stub registers itself in ``--namespace`` exactly as
``executor_svc`` does (the same ``Registration`` heartbeat and ``Member``
record); without it, only a scheduler started with ``--executor`` reaches it
(and registers it on its behalf). Like the real executor it refuses a plan from
a stale epoch or for another instance (FAILED_PRECONDITION). On SIGTERM it
deletes its record and exits at once: a stub holds no KV worth draining.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from executor_svc import model
from executor_svc.lifecycle import Lifecycle, Registration
from executor_svc.runner import PlanRunner
from executor_svc.transfer import LendError, Lends, refs
from pagedserve import heap, rpc
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.keys import Keys
from pagedserve.members import ROLES, Member, Registry

log = logging.getLogger("stub_executor")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


@dataclass(frozen=True, slots=True)
class StepModel:
    """Modelled times in ms: a step of ``prefill`` tokens and ``decode`` sequences takes ``a + b x prefill + c x
    decode``; a pull of ``n`` blocks ``pull_fixed + pull_per_block x n``."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    pull_fixed: float = 0.0
    pull_per_block: float = 0.0

    def step_ms(self, prefill: int, decode: int) -> float:
        return self.a + self.b * prefill + self.c * decode

    def pull_ms(self, blocks: int) -> float:
        return self.pull_fixed + self.pull_per_block * blocks


def plan_shape(plan: pb.StepPlan) -> tuple[int, int]:
    """(prefill tokens, decode sequences) of a plan: a sequence that runs one token and samples is a decode (a
    pipelined plan's decode names its token as ``from_last_sample``: the executor's latest sample, appended)."""
    prefill = decode = 0
    for s in plan.seqs:
        n = len(s.token_ids) + s.from_last_sample + len(s.draft_token_ids)
        if s.sample and n == 1:
            decode += 1
        else:
            prefill += n
    return prefill, decode


def floats(text: str, n: int) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(","))
    if len(values) != n or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected {n} comma-separated non-negative numbers, got {text!r}")
    return values


class StubExecutor(pb_grpc.ExecutorServicer):
    def __init__(
        self,
        model_dir: Path,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        step_ms: float = 0.0,
        dtype: str = "float32",
        lifecycle: Lifecycle | None = None,
        role: str = "mixed",
        step_model: StepModel | None = None,
    ) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.token = min(100, self.vocab_size - 1)  # any ordinary token; never eos for SmolLM2-like vocabularies
        self.step_s = step_ms / 1e3
        self.model = step_model  # None: every step takes step_ms
        self.pull_model = step_model or StepModel()
        self.block_bytes = block_size * kv_bytes_per_token(config)  # what a real block of this model would carry
        self.lends = Lends()
        self._peers: dict[str, grpc.aio.Channel] = {}
        self.lifecycle = lifecycle or Lifecycle()
        self.tokenizer_files = model.tokenizer_files(model_dir)
        self.instance_id = uuid.uuid4().hex
        self._epoch = 0  # the highest loop epoch seen
        self.runner = PlanRunner(self._run)  # one plan at a time, in order, as the real executor
        self._info = pb.InfoResponse(
            model=f"stub:{model_dir.name}",
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len,
            eos_token_ids=model.eos_ids(model_dir, config.get("eos_token_id")),
            vocab_size=self.vocab_size,
            device="none",
            attention_backend="stub",
            dtype=dtype,
            model_digest=model.digest(self.tokenizer_files),
            pipelined=True,
            role=role,
        )

    def info(self, with_tokenizer: bool = True) -> pb.InfoResponse:
        info = pb.InfoResponse()
        info.CopyFrom(self._info)
        info.instance_id = self.instance_id
        info.state = self.lifecycle.state
        info.evacuate_at_ms = self.lifecycle.evacuate_at_ms
        if with_tokenizer:
            info.tokenizer_files.update(self.tokenizer_files)
        return info

    def member(self, address: str) -> Member:
        return Member.from_info(self.info(with_tokenizer=False), address)

    def renew_instance(self) -> str:
        self._epoch = 0
        self.lends.clear()
        self.instance_id = uuid.uuid4().hex
        return self.instance_id

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        if request.renew_instance:
            async with self.runner.lock:
                self.renew_instance()
        return self.info()

    async def Step(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        return await self.runner.one(request, context)

    async def Steps(
        self, requests: AsyncIterator[pb.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        async for result in self.runner.stream(requests, context):
            yield result

    async def _run(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        t = time.perf_counter()
        if request.instance_id and request.instance_id != self.instance_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"instance_id: this executor is {self.instance_id}, not {request.instance_id}",
            )
        if request.epoch < self._epoch:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"epoch: {request.epoch} is stale; a loop with epoch {self._epoch} leads",
            )
        self._epoch = request.epoch
        if request.reset_tables:
            self.lends.clear()
        for lend_id in request.unlends:
            self.lends.unlend(lend_id)
        for lend in request.lends:
            self.lends.lend(lend.lend_id, refs(lend.blocks))
        pulls = [asyncio.ensure_future(self._pull(p)) for p in request.pulls]  # beside the "forward pass"
        step_s = self.step_s if self.model is None else self.model.step_ms(*plan_shape(request)) / 1e3
        if step_s > 0:
            await asyncio.sleep(step_s)
        forward_ms = (time.perf_counter() - t) * 1e3
        pulled = await asyncio.gather(*pulls)
        outputs = [pb.SeqOutput(request_id=s.request_id, token_id=self.token) for s in request.seqs if s.sample]
        return pb.StepResult(
            step_id=request.step_id,
            outputs=outputs,
            swapped_out=len(request.swap_out),
            swapped_in=len(request.swap_in),
            forward_ms=forward_ms,
            step_ms=(time.perf_counter() - t) * 1e3,
            pulls=pulled,
        )

    async def _pull(self, p: pb.Pull) -> pb.PullResult:
        """Ask the source's ``ReadBlocks`` (it refuses what it did not lend), then sleep the modelled transfer."""
        t = time.perf_counter()
        try:
            if len(p.src) != len(p.dst):
                raise ValueError(f"{len(p.src)} source blocks, {len(p.dst)} destinations")
            ch = self._peers.get(p.address)
            if ch is None:
                ch = self._peers[p.address] = grpc.aio.insecure_channel(p.address)
            call = pb_grpc.ExecutorStub(ch).ReadBlocks(
                pb.ReadBlocksRequest(
                    instance_id=p.src_instance_id,
                    epoch=p.src_epoch,
                    lend_id=p.lend_id,
                    blocks=p.src,
                    reader_instance_id=self.instance_id,
                ),
                timeout=30,
            )
            seen = sum([c.count async for c in call])
            if seen != len(p.dst):
                raise ValueError(f"{seen} of {len(p.dst)} blocks came")
            await asyncio.sleep(max(0.0, self.pull_model.pull_ms(len(p.dst)) / 1e3 - (time.perf_counter() - t)))
        except grpc.aio.AioRpcError as exc:
            return pb.PullResult(
                request_id=p.request_id, ok=False, error=f"{exc.code().name}: {exc.details()}", ms=_ms(t)
            )
        except ValueError as exc:
            return pb.PullResult(request_id=p.request_id, ok=False, error=str(exc), ms=_ms(t))
        return pb.PullResult(request_id=p.request_id, ok=True, bytes=len(p.dst) * self.block_bytes, ms=_ms(t))

    async def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.BlockChunk]:
        """The real executor's checks; then one chunk naming the blocks, with no KV in it."""
        try:
            if request.instance_id != self.instance_id:
                raise LendError(f"instance_id: this executor is {self.instance_id}, not {request.instance_id}")
            if request.epoch < self._epoch:
                raise LendError(f"epoch: {request.epoch} is stale; a loop with epoch {self._epoch} leads")
            self.lends.check(request.lend_id, refs(request.blocks))
        except LendError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        yield pb.BlockChunk(first=0, count=len(request.blocks))

    async def close(self) -> None:
        for ch in self._peers.values():
            await ch.close()


def _ms(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


def kv_bytes_per_token(config: dict) -> int:
    """K and V of every layer for one token at fp32 (benchmarks.config.kv_bytes_per_token, from a parsed config)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * (config.get("num_key_value_heads") or heads) * head_dim * 4


async def serve(args: argparse.Namespace) -> None:
    step_model = None
    if args.step_model is not None:
        step_model = StepModel(*args.step_model, *args.pull_model)
    stub = StubExecutor(
        Path(args.model),
        args.num_gpu_blocks,
        args.block_size,
        args.max_model_len,
        args.step_ms,
        args.dtype,
        role=args.role,
        step_model=step_model,
    )
    server, health, port = rpc.make_server(
        f"{args.host}:{args.port}", [(pb_grpc.add_ExecutorServicer_to_server, stub, SERVICE_NAME)]
    )
    await server.start()
    heap.settle()  # as the executor it stands in for
    await rpc.set_serving(health, [SERVICE_NAME], True)
    stop = await rpc.stop_on_signals()
    client, registration, beat = None, None, None
    if args.redis_url:
        address = args.advertise_address or f"{args.host}:{port}"
        client = aioredis.from_url(args.redis_url, decode_responses=True)
        registration = Registration(
            Registry(client, Keys(args.namespace)),
            stub.lifecycle,
            lambda: stub.member(address),
            stub.renew_instance,
            args.lease_ms,
        )
        beat = asyncio.create_task(registration.run(stop))
        log.info("stub %s registering as %s in namespace %s", stub.instance_id, address, args.namespace)
    await stop.wait()
    if registration is not None and beat is not None and client is not None:
        await beat
        await registration.leave()
        await client.aclose()
    await server.stop(grace=1)
    await stub.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stub_executor", description=__doc__)
    p.add_argument("--model", required=True, help="model directory (tokenizer files, config.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--num-gpu-blocks", type=int, default=1 << 17)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1 << 16)
    p.add_argument("--dtype", default="float32", help="reported in Info (part of the namespace identity)")
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="simulated time per Step (asyncio.sleep); 0 answers at once"
    )
    p.add_argument(
        "--step-model",
        type=lambda t: floats(t, 3),
        default=None,
        metavar="A,B,C",
        help="modelled time per Step in ms, A + B x prefill tokens + C x decode sequences (in place of --step-ms)",
    )
    p.add_argument(
        "--pull-model",
        type=lambda t: floats(t, 2),
        default=(0.0, 0.0),
        metavar="D,E",
        help="with --step-model: modelled time of a pull from a peer in ms, D + E x blocks (no KV moves)",
    )
    p.add_argument("--role", choices=ROLES, default="mixed", help="registered as the executor's --role")
    p.add_argument("--redis-url", default=None, help="register in this Redis (default: don't; use --executor)")
    p.add_argument(
        "--advertise-address",
        default=None,
        metavar="HOST:PORT",
        help="where schedulers reach this stub (default: --host and --port)",
    )
    p.add_argument("--namespace", default="pagedserve")
    p.add_argument("--lease-ms", type=int, default=10_000, help="time-to-live of the membership record")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    rpc.run_service(serve, args, args.log_level)


if __name__ == "__main__":
    main()
