"""The API process of a scheduler replica (roles ``all`` and ``frontend``): the public gRPC
and HTTP ports, the frontend and its background tasks, and (role ``all``) the loops' child
process, supervised."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from pagedserve import heap, lora, metrics, rpc, tracing
from pagedserve.auth import api_key_interceptor
from pagedserve.members import Registry
from pagedserve.redis_check import require as require_redis
from pagedserve.security import (
    ReloadingCertificate,
    ReloadingSSLContext,
    reload_on_sighup,
    server_tls,
)
from scheduler_svc.frontend import http_app, validate
from scheduler_svc.frontend.attachments import Attachments
from scheduler_svc.frontend.bus import EventBus
from scheduler_svc.frontend.grpc_api import (
    SERVICE_NAME,
    GenerationServicer,
    add_to_server,
)
from scheduler_svc.frontend.loras import LoraRegistry
from scheduler_svc.frontend.models import Models
from scheduler_svc.frontend.refusals import Refusal
from scheduler_svc.frontend.service import Frontend
from scheduler_svc.frontend.watch import ClusterWatch
from scheduler_svc.metrics import FrontendMetrics
from scheduler_svc.state.store import RedisStore

log = logging.getLogger("scheduler_svc")


def _caps(args: argparse.Namespace) -> validate.Caps:
    return validate.Caps(
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_prompt_bytes=args.max_prompt_bytes,
        max_logprobs=args.max_logprobs,
        max_grammar_bytes=args.max_grammar_bytes,
        max_n=args.max_n,
    )


async def _supervise(args: argparse.Namespace, stop: asyncio.Event, metrics_port: int) -> None:
    """Run the loops as ``python -m scheduler_svc --role loop`` with the same flags, and
    keep that process alive; if it dies, other replicas take its leases meanwhile. Its
    metrics are served on ``metrics_port`` of the loopback (0: off)."""
    argv = [
        sys.executable,
        "-m",
        "scheduler_svc",
        *args.argv,
        "--role",
        "loop",
        "--metrics-port",
        str(metrics_port),
        "--metrics-host",
        "127.0.0.1",
    ]
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


def _public_server(
    args: argparse.Namespace, frontend: Frontend, certificate: ReloadingCertificate | None
) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """The public gRPC port: the Generation service with its limits, TLS and API keys (not started)."""
    return rpc.make_server(
        f"{args.host}:{args.port}",
        [
            (
                functools.partial(add_to_server, max_request_bytes=args.max_request_bytes),
                GenerationServicer(frontend),
                SERVICE_NAME,
            )
        ],
        reflect=True,
        credentials=certificate.credentials() if certificate else None,
        interceptors=[api_key_interceptor(args.api_keys)] if args.api_keys else (),
        max_receive_bytes=max(rpc.PUBLIC_MAX_MESSAGE_BYTES, args.max_request_bytes),
        max_concurrent_streams=rpc.PUBLIC_MAX_CONCURRENT_STREAMS,
    )


async def serve(args: argparse.Namespace) -> None:
    """The public API (and, with role ``all``, the loops in a child process).

    The loops run in their own process, as vLLM separates its engine core from
    its API server: streaming and detokenizing for hundreds of requests must
    not stall the steps the executors wait on. Both sides talk only via Redis.
    The API answers at once; health says SERVING once an executor serves.
    """
    await require_redis(args.redis_url)  # wrong or missing credentials: one clear line, exit 2
    registry = CollectorRegistry()
    exported = args.metrics_port or args.http_port  # the HTTP door serves /metrics too
    loop_metrics_port = rpc.free_port() if exported and args.role == "all" else 0
    if loop_metrics_port:
        registry.register(metrics.ChildCollector(f"http://127.0.0.1:{loop_metrics_port}/metrics"))
    exposed = metrics.view(registry, args.metrics_prefix)
    metrics.serve(args.metrics_port, exposed, args.metrics_host)
    traces = tracing.setup("scheduler_svc", args.otlp_traces_endpoint)
    parts = _frontend(args, registry, traces.tracer if traces else None)
    frontend = parts.frontend
    for name, path in lora.parse_modules(args.lora_modules):  # --lora-modules: registered for the namespace
        try:
            await frontend.loras.register(name, path)
        except Refusal as exc:
            raise SystemExit(f"error: --lora-modules {name}: {exc}") from None
    certificate = server_tls(args.tls, verify_clients=False)
    server, health, port = _public_server(args, frontend, certificate)
    https = ReloadingSSLContext(certificate.cert, certificate.key) if args.http_port and certificate else None
    reload_on_sighup([certificate, https, args.api_keys, args.internal_token])
    await rpc.set_serving(health, [SERVICE_NAME], False)
    stop = await rpc.stop_on_signals()
    http = await _http(args, frontend, https, exposed)
    await server.start()
    tasks = [
        asyncio.create_task(parts.bus.run(stop)),
        asyncio.create_task(parts.watch.run(stop, health, [SERVICE_NAME])),
        asyncio.create_task(parts.attachments.run(stop)),
    ]
    if args.role == "all":
        tasks.append(asyncio.create_task(_supervise(args, stop, loop_metrics_port)))
    _log_ports(args, port, certificate is not None, http)
    heap.settle()  # keep the collector's full passes off the streams
    await stop.wait()
    # Drain: open streams end UNAVAILABLE (HTTP: an error event) with where to resume; their
    # requests go on, and this replica's loops hand their leases over as the loop process stops.
    frontend.drain()
    await health.enter_graceful_shutdown()
    await asyncio.gather(server.stop(grace=5), *([http.stop()] if http is not None else []))
    await asyncio.gather(*tasks, return_exceptions=True)
    await parts.client.aclose()
    if traces is not None:
        traces.shutdown()


@dataclass(slots=True)
class _Parts:
    """The API's pieces over one Redis client: what ``serve`` runs and stops."""

    client: aioredis.Redis
    frontend: Frontend
    bus: EventBus
    watch: ClusterWatch
    attachments: Attachments


def _frontend(args: argparse.Namespace, registry: CollectorRegistry, tracer: Tracer | None) -> _Parts:
    # Thousands of concurrent streams share a bounded pool and wait for a free
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        args.redis_url, max_connections=64, timeout=None, decode_responses=True
    )
    client = aioredis.Redis.from_pool(pool)
    store = RedisStore(client, args.namespace, args.result_ttl)
    watch = ClusterWatch(Registry(client, store.keys), args.max_model_len, dial=args.dialer.channel)
    bus = EventBus(store)
    attachments = Attachments(store, args.policy, args.detach_timeout)
    frontend = Frontend(
        store,
        bus,
        watch,
        args.policy,
        attachments,
        FrontendMetrics(registry),
        tracer,
        caps=_caps(args),
        max_pending=args.max_pending_requests,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else "",
        loras=LoraRegistry(client, store.keys, args.enable_lora, args.max_lora_rank),
    )
    return _Parts(client, frontend, bus, watch, attachments)


async def _http(
    args: argparse.Namespace, frontend: Frontend, https: ReloadingSSLContext | None, exposed: CollectorRegistry
) -> http_app.HttpServer | None:
    if not args.http_port:
        return None
    door = http_app.Door(
        frontend,
        args.max_request_bytes,
        Models(frontend.watch, tuple(args.served_model_name or ()), int(time.time())),
        exposed,
        version("pagedserve"),
    )
    try:
        return await http_app.serve(door, args.http_host, args.http_port, api_keys=args.api_keys, tls=https)
    except OSError as exc:
        raise SystemExit(f"error: {exc}") from None  # one line, exit 1


def _log_ports(args: argparse.Namespace, port: int, tls: bool, http: http_app.HttpServer | None) -> None:
    log.info(
        "scheduler serving on port %d (role %s, namespace %s, %s, %s, executors: %s)",
        port,
        args.role,
        args.namespace,
        args.policy,
        args.preemption_mode,
        ", ".join(args.executor) or "registered",
    )
    log.info(
        "public port: %s, %s; executors dialled %s%s",
        "TLS" if tls else "plaintext",
        "API key required" if args.api_keys else "no API key",
        "over TLS" if args.tls.ca else "in plaintext",
        " with the internal token" if args.internal_token else "",
    )
    if http is not None:
        log.info(
            "OpenAI-compatible HTTP on port %d (%s, %s)",
            http.port,
            "HTTPS" if http.tls else "plain HTTP",
            "API key required" if args.api_keys else "no API key",
        )
