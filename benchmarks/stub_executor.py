"""``python -m benchmarks.stub_executor``: a real ``pagedserve.executor.v1.Executor`` gRPC server with no model.

``Step`` answers with one token per sampled sequence, either at once (the
default: a scheduler driving it spends its step time on scheduling, Redis and
the gRPC round trip only, which is what the scheduler-overhead benchmark
measures) or after ``--step-ms`` of simulated forward pass (``asyncio.sleep``:
the process stays idle meanwhile, as a CPU host waiting on its GPU would), which
is what the scale-out benchmark uses. ``Info`` serves the model directory's
real tokenizer files, eos ids and vocabulary size, so the scheduler's frontend
works unchanged.

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
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from executor_svc import model
from executor_svc.lifecycle import Lifecycle, Registration
from executor_svc.runner import PlanRunner
from pagedserve import heap, rpc
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.keys import Keys
from pagedserve.members import Member, Registry

log = logging.getLogger("stub_executor")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


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
    ) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.token = min(100, self.vocab_size - 1)  # any ordinary token; never eos for SmolLM2-like vocabularies
        self.step_s = step_ms / 1e3
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
        if self.step_s > 0:
            await asyncio.sleep(self.step_s)
        forward_ms = (time.perf_counter() - t) * 1e3
        outputs = [pb.SeqOutput(request_id=s.request_id, token_id=self.token) for s in request.seqs if s.sample]
        return pb.StepResult(
            step_id=request.step_id,
            outputs=outputs,
            swapped_out=len(request.swap_out),
            swapped_in=len(request.swap_in),
            forward_ms=forward_ms,
            step_ms=(time.perf_counter() - t) * 1e3,
        )


async def serve(args: argparse.Namespace) -> None:
    stub = StubExecutor(
        Path(args.model), args.num_gpu_blocks, args.block_size, args.max_model_len, args.step_ms, args.dtype
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
