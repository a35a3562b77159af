"""``python -m scheduler_svc``: the public Generation API and the scheduling loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import uuid

import grpc
import redis.asyncio as aioredis

from scheduler_svc.core.queue import POLICIES
from scheduler_svc.core.scheduler import PREEMPTION_MODES, SchedulerConfig
from scheduler_svc.frontend import EventBus, Frontend, load_tokenizer
from scheduler_svc.loop import Loop
from scheduler_svc.server import SERVICE_NAME, GenerationServicer
from scheduler_svc.store import RedisStore
from scheduler_svc.validate import Limits
from pagedserve import rpc
from pagedserve.executor.v1 import executor_pb2 as epb
from pagedserve.executor.v1 import executor_pb2_grpc as epb_grpc
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("scheduler_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL (required)")
    p.add_argument("--executor", default="localhost:50061", help="executor_svc address HOST:PORT")
    p.add_argument("--policy", choices=POLICIES, default="fcfs")
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step at most")
    p.add_argument("--max-model-len", type=int, default=0, help="context limit (default: the executor's)")
    p.add_argument("--watermark", type=float, default=0.01, help="fraction of KV blocks kept free when admitting")
    p.add_argument("--namespace", default="pagedserve", help="prefix of every Redis key")
    p.add_argument("--replica-id", default=None, help="name in the leader lease (default: host-pid)")
    p.add_argument("--lease-ms", type=int, default=10_000, help="leader lease time-to-live")
    p.add_argument("--step-log", default=None, help="append one JSON line of statistics per step to this file")
    p.add_argument("--role", choices=("all", "frontend", "loop"), default="all",
                   help="all: the API here and the scheduling loop in a child process; or either one alone")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not args.redis_url:
        p.error("--redis-url (or $REDIS_URL) is required")
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        p.error("--max-num-seqs and --max-num-batched-tokens must be positive")
    return args


async def _executor_info(stub: epb_grpc.ExecutorStub) -> epb.InfoResponse:
    """Wait for the executor: it may still be loading its model."""
    while True:
        try:
            return await stub.Info(epb.InfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.info("waiting for executor (%s)", exc.code().name)
            await asyncio.sleep(1)


def _scheduler_config(args: argparse.Namespace, max_len: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.policy,
        preemption_mode=args.preemption_mode,
        watermark=args.watermark,
    )


async def run_loop(args: argparse.Namespace) -> None:
    """The scheduling loop alone: takes the lease when free and steps the executor."""
    client = aioredis.from_url(args.redis_url, decode_responses=True)
    channel = grpc.aio.insecure_channel(args.executor, options=rpc.CHANNEL_OPTIONS)
    executor = epb_grpc.ExecutorStub(channel)
    info = await _executor_info(executor)
    max_len = min(args.max_model_len or info.max_model_len, info.max_model_len)
    step_log = open(args.step_log, "a") if args.step_log else None  # noqa: SIM115 - lives as long as the loop
    replica = args.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    loop = Loop(RedisStore(client, args.namespace), executor, _scheduler_config(args, max_len), replica,
                args.lease_ms, step_log)
    stop = await rpc.stop_on_signals()
    await loop.run(stop)
    await channel.close()
    await client.aclose()
    if step_log:
        step_log.close()


async def _supervise(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """Run the loop as ``python -m scheduler_svc --role loop`` with the same flags, and
    keep it alive; if it dies, another replica may lead meanwhile."""
    argv = [sys.executable, "-m", "scheduler_svc", *args.argv, "--role", "loop"]
    proc: asyncio.subprocess.Process | None = None
    while not stop.is_set():
        if proc is None or proc.returncode is not None:
            if proc is not None:
                log.error("scheduling loop process exited with %s; restarting it", proc.returncode)
            proc = await asyncio.create_subprocess_exec(*argv)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    if proc is not None and proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()


async def serve(args: argparse.Namespace) -> None:
    """The public API (and, with role ``all``, the loop in a child process).

    The loop runs in its own process, as vLLM separates its engine core from
    its API server: streaming and detokenizing for hundreds of requests must
    not stall the step the executor waits on. Both sides talk only via Redis.
    """
    if args.role == "loop":
        await run_loop(args)
        return
    # Thousands of concurrent streams share a bounded pool and wait for a free
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(args.redis_url, max_connections=64, timeout=None,
                                                     decode_responses=True)
    client = aioredis.Redis.from_pool(pool)
    store = RedisStore(client, args.namespace)
    channel = grpc.aio.insecure_channel(args.executor, options=rpc.CHANNEL_OPTIONS)
    info = await _executor_info(epb_grpc.ExecutorStub(channel))
    await channel.close()
    max_len = min(args.max_model_len or info.max_model_len, info.max_model_len)
    limits = Limits(max_model_len=max_len, vocab_size=info.vocab_size, block_size=info.block_size,
                    num_blocks=info.num_gpu_blocks)
    bus = EventBus(store)
    frontend = Frontend(store, bus, load_tokenizer(dict(info.tokenizer_files)), limits)
    server, health, port = rpc.make_server(
        f"{args.host}:{args.port}",
        [(pb_grpc.add_GenerationServicer_to_server, GenerationServicer(frontend), SERVICE_NAME)],
        reflect=True,
    )
    stop = await rpc.stop_on_signals()
    await server.start()
    tasks = [asyncio.create_task(bus.run(stop))]
    if args.role == "all":
        tasks.append(asyncio.create_task(_supervise(args, stop)))
    await rpc.set_serving(health, [SERVICE_NAME], True)
    log.info("scheduler serving on port %d (role %s, executor %s, model %s, %d blocks of %d tokens, %s, %s)",
             port, args.role, args.executor, info.model, info.num_gpu_blocks, info.block_size, args.policy,
             args.preemption_mode)
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(grace=5)
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rpc.run_service(serve, args, args.log_level)


if __name__ == "__main__":
    main()
