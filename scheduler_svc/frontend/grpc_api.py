"""Thin gRPC servicer for the public API: protobuf in, one Frontend call, protobuf out.

The service is registered with ``add_to_server``, which takes each request as
bytes and parses it here: grpcio answers a message it cannot deserialize with
UNKNOWN, while a malformed request deserves INVALID_ARGUMENT, and a request
over ``--max-request-bytes`` is refused before it is parsed at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pagedserve import handlers
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.frontend.service import (
    Frontend,
    NotFound,
    OutOfRange,
    TooManyPending,
)
from scheduler_svc.frontend.streams import Chunk, QueueTimeout, StreamDetached
from scheduler_svc.frontend.validate import (
    MAX_REQUEST_BYTES,
    InvalidArgument,
    OverCapacity,
    Unavailable,
)
from scheduler_svc.state.store import UNAVAILABLE, DuplicateRequest

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


# Trailing metadata of a stream a draining replica ends: where to resume it.
RESUME_ID, RESUME_OFFSET = "pagedserve-request-id", "pagedserve-offset"
# Trailing metadata of a request refused under --max-pending-requests: seconds to wait
# (an integer >= 1, as HTTP's Retry-After).
RETRY_AFTER = "retry-after"


async def _stream(
    chunks: AsyncIterator[Chunk], context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.GenerateResponse]:
    """Chunks as responses; a drained stream ends UNAVAILABLE with where to resume."""
    try:
        async for chunk in chunks:
            yield chunk.to_pb()
    except StreamDetached as exc:
        context.set_trailing_metadata(((RESUME_ID, exc.request_id), (RESUME_OFFSET, str(exc.offset))))
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            req, stop = self.frontend.prepare(request, context.time_remaining())
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            async for resp in _stream(self.frontend.generate(req, stop), context):
                yield resp
        except DuplicateRequest:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {req.request_id!r} is already running")
        except TooManyPending as exc:
            context.set_trailing_metadata(((RETRY_AFTER, str(exc.retry_after)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except QueueTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except UNAVAILABLE as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {exc}")

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be set")
        try:
            index = request.index if request.HasField("index") else None
            async for resp in _stream(self.frontend.resume(request.request_id, request.offset, index), context):
                yield resp
        except NotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except OutOfRange as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except QueueTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except UNAVAILABLE as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {exc}")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be set")
        try:
            return pb.AbortResponse(found=await self.frontend.abort(request.request_id))
        except UNAVAILABLE as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {exc}")


def add_to_server(
    servicer: GenerationServicer, server: grpc.aio.Server, max_request_bytes: int = MAX_REQUEST_BYTES
) -> None:
    """Register the Generation service, parsing requests in the handlers (in place of
    ``generation_pb2_grpc.add_GenerationServicer_to_server``; same names, same messages)."""
    handlers.register(
        server,
        pb.DESCRIPTOR.services_by_name["Generation"],
        {
            "Generate": handlers.stream(servicer.Generate, pb.GenerateRequest, max_request_bytes),
            "Resume": handlers.stream(servicer.Resume, pb.ResumeRequest, max_request_bytes),
            "Abort": handlers.unary(servicer.Abort, pb.AbortRequest, max_request_bytes),
        },
    )
