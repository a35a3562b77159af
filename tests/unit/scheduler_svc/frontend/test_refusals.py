"""The refusals table (scheduler_svc/frontend/refusals.py): every kind has a gRPC code, an HTTP
status and an OpenAI error type; both doors translate through it; the context-length refusal
speaks OpenAI's words. No processes, no I/O."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import redis

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.core.request import DEFAULT_MAX_TOKENS, Params
from scheduler_svc.frontend import openai_request as proto
from scheduler_svc.frontend import refusals
from scheduler_svc.frontend.grpc_api import RESUME_ID, RESUME_OFFSET, RETRY_AFTER, GenerationServicer
from scheduler_svc.frontend.refusals import (
    TABLE,
    AlreadyRunning,
    ContextLength,
    InvalidArgument,
    Kind,
    StreamDetached,
    TooManyPending,
    Unavailable,
)
from scheduler_svc.frontend.validate import Limits, check, check_length
from scheduler_svc.state.store import DuplicateRequest

Code = grpc.StatusCode
LIMITS = Limits(max_model_len=512, vocab_size=1000, block_size=16, pools=((24, 512),))
CONTEXT = (
    "This model's maximum context length is 512 tokens. However, you requested 616 tokens "
    "(600 in the messages, 16 in the completion). Please reduce the length of the messages or completion."
)

# What each door has answered since before the table: pinned, so that the table changes nothing.
EXPECTED: dict[Kind, tuple[grpc.StatusCode, int, str, str | None]] = {
    Kind.INVALID_ARGUMENT: (Code.INVALID_ARGUMENT, 400, "invalid_request_error", None),
    Kind.CONTEXT_LENGTH: (Code.INVALID_ARGUMENT, 400, "invalid_request_error", "context_length_exceeded"),
    Kind.OVER_CAPACITY: (Code.RESOURCE_EXHAUSTED, 400, "invalid_request_error", "context_length_exceeded"),
    Kind.TOO_MANY_PENDING: (Code.RESOURCE_EXHAUSTED, 429, "requests", "rate_limit_exceeded"),
    Kind.DUPLICATE_REQUEST: (Code.ALREADY_EXISTS, 409, "invalid_request_error", "duplicate_request_id"),
    Kind.QUEUE_TIMEOUT: (Code.DEADLINE_EXCEEDED, 504, "timeout", "queue_timeout"),
    Kind.UNAVAILABLE: (Code.UNAVAILABLE, 503, "server_error", "unavailable"),
    Kind.STREAM_DETACHED: (Code.UNAVAILABLE, 503, "server_error", "stream_detached"),
    Kind.NOT_FOUND: (Code.NOT_FOUND, 404, "invalid_request_error", None),
    Kind.OUT_OF_RANGE: (Code.OUT_OF_RANGE, 400, "invalid_request_error", None),
    Kind.MODEL_NOT_FOUND: (Code.NOT_FOUND, 404, "invalid_request_error", "model_not_found"),
    Kind.REQUEST_TOO_LARGE: (Code.INVALID_ARGUMENT, 413, "invalid_request_error", "request_too_large"),
    Kind.UNAUTHENTICATED: (Code.UNAUTHENTICATED, 401, "invalid_request_error", "invalid_api_key"),
    Kind.INTERNAL: (Code.INTERNAL, 500, "server_error", None),
}


def test_every_kind_has_a_grpc_code_an_http_status_and_an_openai_type() -> None:
    assert set(TABLE) == set(Kind)
    for kind, row in TABLE.items():
        assert isinstance(row.grpc_code, grpc.StatusCode) and row.grpc_code != Code.OK, kind
        assert 400 <= row.http_status < 600 and row.type, kind
        assert (row.grpc_code, row.http_status, row.type, row.code) == EXPECTED[kind], kind
        err = proto.refused(kind, "why")
        assert (err.status, err.type, err.code) == EXPECTED[kind][1:], kind
    assert proto.refused(Kind.DUPLICATE_REQUEST, "x").headers == {"x-should-retry": "false"}
    assert proto.refused(Kind.QUEUE_TIMEOUT, "x").headers == {"x-should-retry": "false"}
    assert proto.refused(Kind.UNAUTHENTICATED, "x").headers == {"WWW-Authenticate": "Bearer"}


def test_the_context_length_refusal_speaks_openai_and_names_its_field_on_grpc() -> None:
    exc = ContextLength("prompt", 512, 600, DEFAULT_MAX_TOKENS)
    assert exc.kind == Kind.CONTEXT_LENGTH and exc.field == "prompt" and isinstance(exc, InvalidArgument)
    assert str(exc) == f"prompt: {CONTEXT}"  # gRPC: INVALID_ARGUMENT, naming the field
    err = proto.error_for(exc)
    assert err is not None
    assert (err.status, err.type, err.param, err.code) == (
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    )
    assert err.message == CONTEXT and err.message.startswith("This model's maximum context length is")
    err = proto.error_for(ContextLength("prompt_token_ids", 512, 600, 16))
    assert err is not None and err.param == "prompt" and err.message == CONTEXT


def test_validation_raises_the_context_length_refusal_with_the_request_s_numbers() -> None:
    with pytest.raises(ContextLength) as info:
        check_length("messages", 512, Params(max_tokens=8), LIMITS)
    assert info.value.field == "messages" and "520 tokens (512 in the messages, 8 in the completion)" in str(info.value)
    with pytest.raises(ContextLength) as info:
        check(pb.GenerateRequest(prompt_token_ids=[7] * 600), LIMITS)
    assert str(info.value) == f"prompt_token_ids: {CONTEXT}"
    with pytest.raises(ContextLength, match=r"\(600 in the messages, 3 in the completion\)"):
        check(pb.GenerateRequest(prompt_token_ids=[7] * 600, sampling=pb.SamplingParams(max_tokens=3)), LIMITS)
    with pytest.raises(InvalidArgument) as plain:
        check_length("prompt", 0, Params(), LIMITS)
    assert plain.value.kind == Kind.INVALID_ARGUMENT and str(plain.value) == "prompt: tokenizes to no tokens"


def test_the_store_s_exceptions_become_refusals_in_one_place() -> None:
    down = refusals.of(redis.ConnectionError("connection refused"))
    assert isinstance(down, Unavailable) and str(down) == "redis unavailable: connection refused"
    dup = refusals.of(DuplicateRequest("r-1"))
    assert isinstance(dup, AlreadyRunning) and dup.kind == Kind.DUPLICATE_REQUEST
    assert str(dup) == "request_id: 'r-1' is already running"
    err = proto.error_for(DuplicateRequest("r-1"))
    assert err is not None and (err.param, err.message) == (
        "X-Request-Id",
        "X-Request-Id: a live request already has this id",
    )
    assert refusals.of(KeyError("x")) is None, "a bug is no refusal"
    same = Unavailable("draining")
    assert refusals.of(same) is same


# --- the gRPC servicer, with a frontend and a context of our own --------------------


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code, details
        raise Aborted


class Frontend:
    """Refuses at ``prepare`` or, after ``chunks`` responses, in ``generate``."""

    def __init__(self, at_prepare: BaseException | None = None, in_generate: BaseException | None = None) -> None:
        self.at_prepare, self.in_generate = at_prepare, in_generate

    def prepare(self, req: pb.GenerateRequest, time_remaining: float | None, lora: Any = None) -> tuple[Any, list[str]]:
        if self.at_prepare is not None:
            raise self.at_prepare
        return object(), []

    async def generate(self, req: Any, stop: list[str]) -> AsyncIterator[Any]:
        if self.in_generate is not None:
            raise self.in_generate
        yield  # pragma: no cover

    async def abort(self, request_id: str) -> bool:
        raise redis.TimeoutError("timed out")


def _generate(frontend: Frontend) -> Context:
    context = Context()

    async def go() -> None:
        with pytest.raises(Aborted):
            async for _ in GenerationServicer(frontend).Generate(pb.GenerateRequest(), context):  # type: ignore[arg-type]
                pass

    asyncio.run(go())
    return context


@pytest.mark.parametrize(
    ("frontend", "code", "details", "trailing"),
    [
        (Frontend(at_prepare=ContextLength("prompt", 512, 600, 16)), Code.INVALID_ARGUMENT, f"prompt: {CONTEXT}", ()),
        (
            Frontend(at_prepare=Unavailable("this replica is draining; use another")),
            Code.UNAVAILABLE,
            "this replica",
            (),
        ),
        (Frontend(in_generate=DuplicateRequest("r")), Code.ALREADY_EXISTS, "request_id: 'r' is already running", ()),
        (Frontend(in_generate=TooManyPending(3, 2, 7)), Code.RESOURCE_EXHAUSTED, "3 requests", ((RETRY_AFTER, "7"),)),
        (Frontend(in_generate=OSError("reset")), Code.UNAVAILABLE, "redis unavailable: reset", ()),
        (
            Frontend(in_generate=StreamDetached("r-9", 12)),
            Code.UNAVAILABLE,
            "this replica is draining; resume r-9 from offset 12",
            ((RESUME_ID, "r-9"), (RESUME_OFFSET, "12")),
        ),
    ],
)
def test_the_grpc_servicer_answers_through_the_table(
    frontend: Frontend, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...]
) -> None:
    context = _generate(frontend)
    assert context.code == code and context.details.startswith(details) and context.trailing == trailing


def test_a_bug_is_no_refusal_and_abort_s_redis_outage_is_unavailable() -> None:
    async def go() -> None:
        with pytest.raises(KeyError):
            async for _ in GenerationServicer(Frontend(at_prepare=KeyError("x"))).Generate(  # type: ignore[arg-type]
                pb.GenerateRequest(), Context()
            ):
                pass
        context = Context()
        with pytest.raises(Aborted):
            await GenerationServicer(Frontend()).Abort(pb.AbortRequest(request_id="r"), context)  # type: ignore[arg-type]
        assert (context.code, context.details) == (Code.UNAVAILABLE, "redis unavailable: timed out")
        context = Context()
        with pytest.raises(Aborted):
            await GenerationServicer(Frontend()).Abort(pb.AbortRequest(), context)  # type: ignore[arg-type]
        assert (context.code, context.details) == (Code.INVALID_ARGUMENT, "request_id: must be set")

    asyncio.run(go())
