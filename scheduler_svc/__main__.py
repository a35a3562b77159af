"""``python -m scheduler_svc``: the public Generation API and the scheduling loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
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
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
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


async def serve(args: argparse.Namespace) -> None:
    client = aioredis.from_url(args.redis_url, decode_responses=True)
    store = RedisStore(client, args.namespace)
    channel = grpc.aio.insecure_channel(args.executor, options=rpc.CHANNEL_OPTIONS)
    executor = epb_grpc.ExecutorStub(channel)
    info = await _executor_info(executor)
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
    config = SchedulerConfig(
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.policy,
        preemption_mode=args.preemption_mode,
        watermark=args.watermark,
    )
    step_log = open(args.step_log, "a") if args.step_log else None  # noqa: SIM115 - lives as long as the loop
    replica = args.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    loop = Loop(store, executor, config, replica, args.lease_ms, step_log)
    stop = asyncio.Event()
    await server.start()
    tasks = [asyncio.create_task(bus.run(stop)), asyncio.create_task(loop.run(stop))]
    await rpc.set_serving(health, [SERVICE_NAME], True)
    log.info("scheduler %s serving on port %d (executor %s, model %s, %d blocks of %d tokens, %s, %s)",
             replica, port, args.executor, info.model, info.num_gpu_blocks, info.block_size, args.policy,
             args.preemption_mode)
    ev_loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        ev_loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(grace=5)
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    await client.aclose()
    if step_log:
        step_log.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
