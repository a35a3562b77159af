"""gRPC plumbing shared by both services: server setup, health, reflection."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

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
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def make_server(
    address: str,
    services: list[tuple[Callable[[object, grpc.aio.Server], None], object, str]],
    *,
    reflect: bool = False,
) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """An aio server with each ``(add_fn, servicer, full_name)`` plus health.

    Returns the server, its health servicer (``set_serving`` sets it) and the
    bound port (useful with port 0).
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health.SERVICE_NAME]
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    if reflect:
        names.append(reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
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


def run_service(serve: Callable[[object], Awaitable[None]], args: object, log_level: str,
                log_format: str = "text") -> None:
    logs.setup(log_level, log_format)
    asyncio.run(serve(args))
