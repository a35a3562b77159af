"""The loops process of a scheduler replica (role ``loop``, or the child of role ``all``).

It imports none of the frontend (no tokenizer, no transformers): it starts in about a second,
and a replica's loops lead their executors soon after the replica starts.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from pagedserve import heap, metrics, rpc, tracing
from pagedserve.keys import Keys
from pagedserve.members import Registry
from pagedserve.redis_check import require as require_redis
from pagedserve.security import reload_on_sighup
from scheduler_svc.core import spec
from scheduler_svc.core.disagg import DisaggConfig
from scheduler_svc.core.migration import MoveConfig
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.loops.manager import Manager
from scheduler_svc.metrics import LoopMetrics, NamespaceMetrics
from scheduler_svc.state.store import RedisStore


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """Per executor, ``max_model_len`` 0 becomes that executor's own."""
    return SchedulerConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.policy,
        preemption_mode=args.preemption_mode,
        watermark=args.watermark,
        enable_prefix_caching=args.enable_prefix_caching,
        max_loras=args.max_loras if args.enable_lora else 0,
        spec=spec.parse(args.speculative_config) if args.speculative_config else None,
    )


async def run_loops(args: argparse.Namespace) -> None:
    """The scheduling loops alone: lead this replica's share of the executors."""
    await require_redis(args.redis_url)  # wrong or missing credentials: one clear line, exit 2
    # Each loop holds a connection while it waits on the doorbell stream.
    pool = aioredis.BlockingConnectionPool.from_url(
        args.redis_url, max_connections=256, timeout=None, decode_responses=True
    )
    client = aioredis.Redis.from_pool(pool)
    keys = Keys(args.namespace)
    step_log = open(args.step_log, "a") if args.step_log else None  # noqa: SIM115 - lives as long as the loops
    replica = args.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    registry = CollectorRegistry()
    metrics.serve(args.metrics_port, metrics.view(registry, args.metrics_prefix), args.metrics_host)
    traces = tracing.setup("scheduler_svc", args.otlp_traces_endpoint)
    manager = Manager(
        RedisStore(client, args.namespace, args.result_ttl),
        Registry(client, keys),
        _scheduler_config(args),
        replica,
        lease_ms=args.lease_ms,
        static=args.executor,
        executor_timeout=args.executor_timeout,
        detach_timeout=args.detach_timeout,
        step_log=step_log,
        metrics=LoopMetrics(registry),
        namespace_metrics=NamespaceMetrics(registry),
        tracer=traces.tracer if traces else None,
        dial=args.dialer.channel,
        async_scheduling=args.async_scheduling,
        moves=MoveConfig(
            args.migration,
            args.peer_prefix,
            args.rebalance,
            args.rebalance_gap,
            args.rebalance_every_ms,
            DisaggConfig(args.disagg_min_prompt_tokens, args.disagg_max_prefill_queue),
        ),
    )
    stop = await rpc.stop_on_signals()
    reload_on_sighup([args.internal_token])
    heap.settle()  # keep the collector off the loops' turns
    await manager.run(stop)
    if traces is not None:
        traces.shutdown()
    await client.aclose()
    if step_log:
        step_log.close()
