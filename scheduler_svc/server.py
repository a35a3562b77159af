"""Thin gRPC servicer for the public API: protobuf in, one Frontend call, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from scheduler_svc.frontend import Frontend
from scheduler_svc.store import DuplicateRequest
from scheduler_svc.validate import InvalidArgument, OverCapacity, Unavailable
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            req, stop = self.frontend.prepare(request)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OverCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            async for chunk in self.frontend.generate(req, stop):
                yield chunk.to_pb()
        except DuplicateRequest:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {req.request_id!r} is already running")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be set")
        return pb.AbortResponse(found=await self.frontend.abort(request.request_id))
