"""Thin gRPC servicer for the public API: protobuf in, one Frontend call, protobuf out.

The service is registered with ``add_to_server``, which takes each request as
bytes and parses it here: grpcio answers a message it cannot deserialize with
UNKNOWN, while a malformed request deserves INVALID_ARGUMENT, and a request
over ``--max-request-bytes`` is refused before it is parsed at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from pagedserve import handlers
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.frontend import refusals, tool_calls, tools
from scheduler_svc.frontend.refusals import InvalidArgument, Refusal, StreamDetached
from scheduler_svc.frontend.service import Frontend
from scheduler_svc.frontend.validate import MAX_REQUEST_BYTES

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


# Trailing metadata of a stream a draining replica ends: where to resume it.
RESUME_ID, RESUME_OFFSET = "pagedserve-request-id", "pagedserve-offset"
# Trailing metadata of a request refused under --max-pending-requests: seconds to wait
# (an integer >= 1, as HTTP's Retry-After).
RETRY_AFTER = "retry-after"


async def _refuse(context: grpc.aio.ServicerContext, refusal: Refusal) -> NoReturn:
    """End the call with the refusal's status code (``refusals.TABLE``) and message; a retry
    hint, or where to resume a detached stream, goes in the trailing metadata."""
    metadata: list[tuple[str, str]] = []
    if refusal.retry_after is not None:
        metadata.append((RETRY_AFTER, str(refusal.retry_after)))
    if isinstance(refusal, StreamDetached):
        metadata += [(RESUME_ID, refusal.request_id), (RESUME_OFFSET, str(refusal.offset))]
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(refusal.answer.grpc_code, str(refusal))
    raise AssertionError("unreachable: ServicerContext.abort raises")


class GenerationServicer(pb_grpc.GenerationServicer):
    """Each method answers the frontend's refusals (and the store's exceptions, through
    ``refusals.of``) in one ``except``; anything else is a bug, which grpcio answers UNKNOWN."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            lora = await self.frontend.loras.resolve(request.lora_name) if request.lora_name else None
            req, stop = self.frontend.prepare(request, context.time_remaining(), lora)
            plan = tools.plan(request, self.frontend.tool_call_parser) if request.tools else None
            texts = tool_calls.Texts(plan)  # the calls on each completion's last message
            async for chunk in self.frontend.generate(req, stop):
                yield texts.annotate(chunk.to_pb())
        except Exception as exc:
            if (refusal := refusals.of(exc)) is None:
                raise
            await _refuse(context, refusal)

    async def LoadLoraAdapter(
        self, request: pb.LoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        try:
            adapter = await self.frontend.loras.register(request.lora_name, request.lora_path)
        except Exception as exc:
            if (refusal := refusals.of(exc)) is None:
                raise
            await _refuse(context, refusal)
        return pb.LoraAdapterResponse(digest=adapter.digest, rank=adapter.rank)

    async def UnloadLoraAdapter(
        self, request: pb.LoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        try:
            await self.frontend.loras.unregister(request.lora_name)
        except Exception as exc:
            if (refusal := refusals.of(exc)) is None:
                raise
            await _refuse(context, refusal)
        return pb.LoraAdapterResponse()

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if not request.request_id:
                raise InvalidArgument("request_id", "must be set")
            index = request.index if request.HasField("index") else None
            async for chunk in self.frontend.resume(request.request_id, request.offset, index):
                yield chunk.to_pb()
        except Exception as exc:
            if (refusal := refusals.of(exc)) is None:
                raise
            await _refuse(context, refusal)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            if not request.request_id:
                raise InvalidArgument("request_id", "must be set")
            return pb.AbortResponse(found=await self.frontend.abort(request.request_id))
        except Exception as exc:
            if (refusal := refusals.of(exc)) is None:
                raise
            await _refuse(context, refusal)


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
            "LoadLoraAdapter": handlers.unary(servicer.LoadLoraAdapter, pb.LoraAdapterRequest, max_request_bytes),
            "UnloadLoraAdapter": handlers.unary(servicer.UnloadLoraAdapter, pb.LoraAdapterRequest, max_request_bytes),
        },
    )
