"""gRPC plumbing shared by both services: server setup, health, reflection."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve import logs

# A health service name that reports SERVING for as long as the process runs: what a
# liveness probe asks. Readiness asks the overall status (""), which a service sets
# NOT_SERVING when it cannot do its job (no Redis, no executor, draining...), and a
# process should not be restarted for that.
LIVENESS = "liveness"
MAX_MESSAGE_BYTES = 64 << 20  # step plans and tokenizer files exceed gRPC's 4 MiB default
# The public port receives only requests: a prompt, messages, sampling parameters. 4 MiB
# (gRPC's own default) is far above any prompt a context window holds and bounds what one
# message can make a replica buffer. The scheduler's --max-request-bytes, if lower, is
# checked in the handler with INVALID_ARGUMENT naming the field; this is the transport's cap
# (a larger message gets RESOURCE_EXHAUSTED before any handler runs).
PUBLIC_MAX_MESSAGE_BYTES = 4 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Streams one connection may have open at once. The public port carries one stream per
# request and clients multiplex many on a channel (the overhead benchmark: 1000); a client
# wanting more opens another connection. An executor sees one Step at a time per loop plus
# an Info now and then.
PUBLIC_MAX_CONCURRENT_STREAMS = 1024
INTERNAL_MAX_CONCURRENT_STREAMS = 64
# Keepalive enforcement: a client may ping at most every 10 s (also on an idle connection,
# so that a long-lived channel stays open through NATs and load balancers); a client
# pinging faster is sent GOAWAY after 2 strikes (gRPC's defaults: 5 min, no pings when
# idle). The server pings an idle connection every 60 s and closes it if the ping goes
# unanswered for 20 s, so that a vanished client's streams end.
KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


def server_options(
    max_receive_bytes: int = MAX_MESSAGE_BYTES, max_concurrent_streams: int = INTERNAL_MAX_CONCURRENT_STREAMS
) -> list[tuple[str, int]]:
    """The server's limits, all of them set here (docs/security.md, "Server limits")."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        *KEEPALIVE_OPTIONS,
    ]


def make_server(
    address: str,
    services: list[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    *,
    reflect: bool = False,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    max_concurrent_streams: int = INTERNAL_MAX_CONCURRENT_STREAMS,
) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """An aio server with each ``(add_fn, servicer, full_name)`` plus health.

    With ``credentials`` (``pagedserve.security``) the port speaks TLS only;
    ``interceptors`` run before every handler (API keys, the internal token).
    Returns the server, its health servicer (``set_serving`` sets it) and the
    bound port (useful with port 0).
    """
    server = grpc.aio.server(
        options=server_options(max_receive_bytes, max_concurrent_streams), interceptors=list(interceptors) or None
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health.SERVICE_NAME]
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    if reflect:
        names.append(reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return server, health_servicer, port


async def set_serving(health_servicer: health.HealthServicer, names: list[str], serving: bool) -> None:
    """Readiness: the overall status and each service's. ``LIVENESS`` stays SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    for name in ["", *names]:
        await health_servicer.set(name, status)


async def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: the services' shutdown trigger."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_service(
    serve: Callable[[Any], Coroutine[Any, Any, None]], args: object, log_level: str, log_format: str = "text"
) -> None:
    logs.setup(log_level, log_format)
    asyncio.run(serve(args))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; a later bind may still race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
