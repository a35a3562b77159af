"""Register a gRPC service whose handlers parse their own requests.

grpcio answers a request it cannot deserialize with UNKNOWN, before any code of
ours runs; a malformed request deserves INVALID_ARGUMENT. The handlers built
here take the raw bytes, refuse them over a size limit, parse them, and call the
servicer's method with the message, so that a service registered with
``register`` answers exactly as the generated ``add_*Servicer_to_server`` would,
except for bytes that are no request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]
Streaming = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Message]]


def _serialize(m: Message) -> bytes:
    return m.SerializeToString()


async def parse(raw: bytes, message: type[Message], max_bytes: int, context: grpc.aio.ServicerContext) -> Any:
    """The request, or INVALID_ARGUMENT: over ``max_bytes`` (0: no limit of ours), or not a ``message``."""
    if max_bytes and len(raw) > max_bytes:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request: {len(raw)} bytes, over the limit of {max_bytes} (--max-request-bytes)",
        )
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {message.DESCRIPTOR.full_name} ({exc})"
        )


def unary(method: Unary, message: type[Message], max_bytes: int = 0) -> grpc.RpcMethodHandler:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        return await method(await parse(raw, message, max_bytes, context), context)

    return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=None, response_serializer=_serialize)


def stream(method: Streaming, message: type[Message], max_bytes: int = 0) -> grpc.RpcMethodHandler:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        request = await parse(raw, message, max_bytes, context)
        async for response in method(request, context):
            yield response

    return grpc.unary_stream_rpc_method_handler(handle, request_deserializer=None, response_serializer=_serialize)


def bidi(
    method: Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Message]],
    message: type[Message],
    max_bytes: int = 0,
) -> grpc.RpcMethodHandler:
    """A stream of requests, each parsed as it arrives (a bad one ends the call with INVALID_ARGUMENT)."""

    async def handle(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        async def requests() -> AsyncIterator[Any]:
            async for raw in raws:
                yield await parse(raw, message, max_bytes, context)

        async for response in method(requests(), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(handle, request_deserializer=None, response_serializer=_serialize)


def register(
    server: grpc.aio.Server, service: ServiceDescriptor, handlers: Mapping[str, grpc.RpcMethodHandler]
) -> None:
    """Serve ``service`` with ``handlers``, one per method of its descriptor."""
    missing = set(service.methods_by_name) ^ set(handlers)
    if missing:
        raise ValueError(f"{service.full_name}: handlers do not match the methods ({sorted(missing)})")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, dict(handlers)),))
