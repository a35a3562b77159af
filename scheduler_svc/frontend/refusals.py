"""Every way the API turns a request down, and the one table of how each door says it.

A ``Refusal`` carries its ``kind`` (a row of ``TABLE``), the ``field`` it is about
(pagedserve.v1's name, e.g. ``sampling.max_tokens``; None when no one field is to
blame) and the ``reason``. The gRPC servicer answers the row's status code with
``str(refusal)``, ``"field: reason"`` as every INVALID_ARGUMENT names its field; the
HTTP door answers the row's status, OpenAI error ``type`` and ``code``, with the
field in OpenAI's terms as ``param`` (``openai_request.api_error``). No door reads a
message to learn what went wrong.

The store's exceptions (Redis unreachable, a duplicate id) become refusals in one
place, ``of``. Two gRPC answers are written outside this table because pagedserve
imports no service: pagedserve/handlers.py (an undecodable or oversized request:
INVALID_ARGUMENT, as ``REQUEST_TOO_LARGE``'s row) and pagedserve/auth.py
(UNAUTHENTICATED, as ``UNAUTHENTICATED``'s row).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import grpc

from scheduler_svc.state.store import UNAVAILABLE, DuplicateRequest

StatusCode = grpc.StatusCode


class Kind(StrEnum):
    INVALID_ARGUMENT = "invalid_argument"  # a field's type or value; a cap (--max-*)
    CONTEXT_LENGTH = "context_length"  # the prompt does not fit the model's context
    OVER_CAPACITY = "over_capacity"  # prompt + max_tokens can never fit any executor's KV pool
    TOO_MANY_PENDING = "too_many_pending"  # --max-pending-requests already wait: retry after the hint
    DUPLICATE_REQUEST = "duplicate_request"  # a live request already has this id
    QUEUE_TIMEOUT = "queue_timeout"  # its queue deadline passed before it started
    UNAVAILABLE = "unavailable"  # no executor yet, this replica drains, Redis is unreachable
    STREAM_DETACHED = "stream_detached"  # the stream ends, the request goes on: resume it
    NOT_FOUND = "not_found"  # Resume: no live or recently finished request has this id
    OUT_OF_RANGE = "out_of_range"  # Resume: an offset or index past what the request has
    MODEL_NOT_FOUND = "model_not_found"  # HTTP: ``model`` is not the served model
    REQUEST_TOO_LARGE = "request_too_large"  # HTTP: the body is over four times --max-request-bytes
    UNAUTHENTICATED = "unauthenticated"  # no API key, or not one of --api-key-file's
    INTERNAL = "internal"  # a bug (never bad input)


@dataclass(frozen=True, slots=True)
class Answer:
    """How both doors say one kind of refusal: the gRPC status code; the HTTP status, OpenAI
    error ``type`` and ``code``, and the headers every such HTTP answer carries."""

    grpc_code: grpc.StatusCode
    http_status: int
    type: str
    code: str | None = None
    headers: tuple[tuple[str, str], ...] = ()


INVALID = "invalid_request_error"
# The openai SDK retries 409 and 5xx by itself: not a duplicate id (it cannot succeed while the
# first runs), nor a queue timeout (the client's own deadline; retrying would wait longer than asked).
NO_RETRY = (("x-should-retry", "false"),)
TABLE: dict[Kind, Answer] = {
    Kind.INVALID_ARGUMENT: Answer(StatusCode.INVALID_ARGUMENT, 400, INVALID),
    # litellm (and other OpenAI clients) map only this code to "the context window is exceeded".
    Kind.CONTEXT_LENGTH: Answer(StatusCode.INVALID_ARGUMENT, 400, INVALID, "context_length_exceeded"),
    # gRPC says the pool is too small; OpenAI answers any overlong context 400.
    Kind.OVER_CAPACITY: Answer(StatusCode.RESOURCE_EXHAUSTED, 400, INVALID, "context_length_exceeded"),
    Kind.TOO_MANY_PENDING: Answer(StatusCode.RESOURCE_EXHAUSTED, 429, "requests", "rate_limit_exceeded"),
    Kind.DUPLICATE_REQUEST: Answer(StatusCode.ALREADY_EXISTS, 409, INVALID, "duplicate_request_id", NO_RETRY),
    Kind.QUEUE_TIMEOUT: Answer(StatusCode.DEADLINE_EXCEEDED, 504, "timeout", "queue_timeout", NO_RETRY),
    Kind.UNAVAILABLE: Answer(StatusCode.UNAVAILABLE, 503, "server_error", "unavailable"),
    Kind.STREAM_DETACHED: Answer(StatusCode.UNAVAILABLE, 503, "server_error", "stream_detached"),
    Kind.NOT_FOUND: Answer(StatusCode.NOT_FOUND, 404, INVALID),
    Kind.OUT_OF_RANGE: Answer(StatusCode.OUT_OF_RANGE, 400, INVALID),
    Kind.MODEL_NOT_FOUND: Answer(StatusCode.NOT_FOUND, 404, INVALID, "model_not_found"),
    Kind.REQUEST_TOO_LARGE: Answer(StatusCode.INVALID_ARGUMENT, 413, INVALID, "request_too_large"),
    Kind.UNAUTHENTICATED: Answer(
        StatusCode.UNAUTHENTICATED, 401, INVALID, "invalid_api_key", (("WWW-Authenticate", "Bearer"),)
    ),
    Kind.INTERNAL: Answer(StatusCode.INTERNAL, 500, "server_error"),
}


class Refusal(Exception):
    """A request turned down. ``retry_after`` (whole seconds) is the hint of a refusal worth
    retrying later: gRPC trailing metadata ``retry-after``, HTTP ``Retry-After``."""

    def __init__(self, kind: Kind, reason: str, field: str | None = None, *, retry_after: int | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.kind = kind
        self.reason = reason
        self.field = field
        self.retry_after = retry_after

    @property
    def answer(self) -> Answer:
        return TABLE[self.kind]

    def openai_message(self, param: str | None) -> str:
        """The HTTP answer's message, naming the field as OpenAI does (``param``)."""
        return f"{param}: {self.reason}" if param else self.reason


class InvalidArgument(Refusal):
    """A field's type or value, or a cap: the message names the field."""

    KIND = Kind.INVALID_ARGUMENT

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(self.KIND, reason, field)


def context_reason(max_model_len: int, num_prompt: int, max_tokens: int) -> str:
    """OpenAI's (and vLLM's) words for an overlong context, which clients match."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the completion). "
        f"Please reduce the length of the messages or completion."
    )


class ContextLength(InvalidArgument):
    """The prompt leaves no room for a token. On HTTP the message is OpenAI's sentence alone
    (clients match its opening words); on gRPC it names the field, as every INVALID_ARGUMENT."""

    KIND = Kind.CONTEXT_LENGTH

    def __init__(self, field: str, max_model_len: int, num_prompt: int, max_tokens: int) -> None:
        super().__init__(field, context_reason(max_model_len, num_prompt, max_tokens))

    def openai_message(self, param: str | None) -> str:
        return self.reason


class OverCapacity(Refusal):
    """The request can never fit in any executor's KV pool."""

    def __init__(self, need: int, largest: int) -> None:
        super().__init__(Kind.OVER_CAPACITY, self._say(need, largest, "sampling.max_tokens"))
        self.need, self.largest = need, largest

    @staticmethod
    def _say(need: int, largest: int, max_tokens: str) -> str:
        return f"prompt + {max_tokens} need {need} KV blocks; the largest executor pool has {largest}"

    def openai_message(self, param: str | None) -> str:
        return self._say(self.need, self.largest, "max_tokens")  # the field as OpenAI names it


class Unavailable(Refusal):
    """Nothing can be served here now (no executor yet, a drain, Redis): worth retrying."""

    def __init__(self, reason: str) -> None:
        super().__init__(Kind.UNAVAILABLE, reason)


class TooManyPending(Refusal):
    """The namespace's queue is at ``--max-pending-requests``; ``retry_after`` seconds is the hint."""

    def __init__(self, queued: int, limit: int, retry_after_s: int) -> None:
        super().__init__(
            Kind.TOO_MANY_PENDING,
            f"{queued} requests are waiting in this namespace, the limit is {limit} "
            f"(--max-pending-requests); retry after {retry_after_s} s",
            retry_after=retry_after_s,
        )


class AlreadyRunning(Refusal):
    """A live request already has this id (the store's ``DuplicateRequest``)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(Kind.DUPLICATE_REQUEST, f"{request_id!r} is already running", "request_id")

    def openai_message(self, param: str | None) -> str:
        return f"{param}: a live request already has this id"


class QueueTimeout(Refusal):
    """The request's queue deadline passed before it started; it was removed and holds nothing."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            Kind.QUEUE_TIMEOUT,
            f"request {request_id} did not start before its deadline (queue_timeout "
            f"or the call's deadline); it was removed from the queue",
            "queue_timeout",
        )


class StreamDetached(Refusal):
    """The stream ends, its request goes on (the replica drains, or Redis is unreachable):
    resume it from ``offset``."""

    def __init__(self, request_id: str, offset: int, why: str = "this replica is draining") -> None:
        super().__init__(Kind.STREAM_DETACHED, f"{why}; resume {request_id} from offset {offset}")
        self.request_id = request_id
        self.offset = offset
        self.why = why


class NotFound(Refusal):
    """No live or recently finished request has this id."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(Kind.NOT_FOUND, reason, field)


class OutOfRange(Refusal):
    """A resume offset past the tokens generated, or an index past the completions."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(Kind.OUT_OF_RANGE, reason, field)


def of(exc: BaseException) -> Refusal | None:
    """``exc`` as a refusal: itself, or the store's exceptions (the one place they are
    translated); None for anything else, which is a bug."""
    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, DuplicateRequest):
        return AlreadyRunning(str(exc))
    if isinstance(exc, UNAVAILABLE):
        return Unavailable(f"redis unavailable: {exc}")
    return None
