"""Shared secrets on gRPC: API keys on the public port, the internal token on executors.

A ``SecretFile`` holds one secret per line (blank lines and ``#`` comments
ignored) and rereads the file when it changes (its mtime, size or inode; checked
on every call, a ``stat``) or when asked to (SIGHUP), so that keys rotate
without a restart: add the new key, move clients over, remove the old one.

``TokenInterceptor`` lets a call through only if its metadata carries one of
the secrets, compared in constant time against every one of them (no early
exit that would tell which key, or how much of one, matched). Health and
reflection stay open, for probes. A refused call gets UNAUTHENTICATED before
its request is even deserialized.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
INTERNAL_TOKEN = "x-pagedserve-internal-token"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def parse_secrets(text: str) -> tuple[bytes, ...]:
    """One per line; surrounding whitespace, blank lines and ``#`` lines dropped."""
    lines = (line.strip() for line in text.splitlines())
    return tuple(line.encode() for line in lines if line and not line.startswith("#"))


@dataclass(slots=True)
class SecretFile:
    """The secrets in ``path``, current as of the last call. ``what`` names the flag in errors."""

    path: Path
    what: str
    _secrets: tuple[bytes, ...] = ()
    _stamp: tuple[int, int, int] | None = None
    _force: bool = False
    _failed: tuple[int, int, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Read at start: a missing, unreadable or empty file is an error here, not a refusal later."""
        self.path = Path(self.path)
        try:
            self._stamp = _stamp(self.path)
            self._secrets = parse_secrets(self.path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.what}: cannot read {self.path}: {exc}") from exc
        if not self._secrets:
            raise ValueError(f"{self.what}: {self.path} holds no secret (one per line; # starts a comment)")

    def request_reload(self) -> None:
        """Reread at the next use even if the file looks unchanged (SIGHUP)."""
        self._force = True

    def current(self) -> tuple[bytes, ...]:
        """The secrets, reread first if the file changed. While the file cannot be read,
        the last good ones stay (a file being replaced is not a reason to lock everyone out);
        a readable file with no secret in it refuses everything, as it says."""
        try:
            stamp = _stamp(self.path)
        except OSError as exc:
            if self._failed is None:
                log.error("%s: cannot read %s (%s); keeping the previous secrets", self.what, self.path, exc)
                self._failed = (0, 0, 0)
            return self._secrets
        if stamp == self._stamp and not self._force:
            return self._secrets
        try:
            secrets = parse_secrets(self.path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            if self._failed != stamp:
                log.error("%s: cannot read %s (%s); keeping the previous secrets", self.what, self.path, exc)
                self._failed = stamp
            return self._secrets
        self._stamp, self._force, self._failed = stamp, False, None
        if secrets != self._secrets:
            log.info("%s: %s reloaded, %d secret(s)", self.what, self.path, len(secrets))
            if not secrets:
                log.warning("%s: %s holds no secret: every call is refused", self.what, self.path)
        self._secrets = secrets
        return secrets

    def first(self) -> str:
        """The first secret: what a client sends (the internal token)."""
        secrets = self.current()
        return secrets[0].decode() if secrets else ""

    def matches(self, candidate: bytes) -> bool:
        """Constant time in the candidate's content: every secret is compared, always."""
        ok = False
        for secret in self.current():
            ok |= hmac.compare_digest(candidate, secret)
        return ok


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[bytes]:
    """The credentials of every ``authorization: Bearer <key>`` entry (scheme case-insensitive)."""
    found = []
    for key, value in metadata or ():
        if key != AUTHORIZATION or not isinstance(value, str):
            continue
        scheme, _, credentials = value.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            found.append(credentials.strip().encode())
    return found


def plain(header: str) -> Callable[[Sequence[tuple[str, str | bytes]] | None], list[bytes]]:
    """The value of every ``header`` entry, as the candidates."""

    def values(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[bytes]:
        return [v.encode() if isinstance(v, str) else v for k, v in metadata or () if k == header]

    return values


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED. It takes the
    request as raw bytes: nothing from an unauthenticated caller is parsed."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    streaming = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[streaming]
    return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer if handler else None)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every method except those under ``open_prefixes`` requires one of ``secrets`` in the
    metadata, as ``candidates`` extracts them."""

    def __init__(
        self,
        secrets: SecretFile,
        candidates: Callable[[Sequence[tuple[str, str | bytes]] | None], list[bytes]],
        message: str,
        open_prefixes: tuple[str, ...],
    ) -> None:
        self.secrets = secrets
        self.candidates = candidates
        self.message = message
        self.open_prefixes = open_prefixes

    def allowed(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        if method.startswith(self.open_prefixes):
            return True
        ok = False
        for candidate in self.candidates(metadata):
            ok |= self.secrets.matches(candidate)
        return ok

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if self.allowed(details.method, details.invocation_metadata):
            return handler
        return _refusal(handler, self.message)


def api_key_interceptor(keys: SecretFile) -> TokenInterceptor:
    """The public port: ``authorization: Bearer <key>``; health and reflection open."""
    return TokenInterceptor(
        keys,
        bearer,
        "missing or invalid API key (metadata authorization: Bearer <key>)",
        (HEALTH_PREFIX, *REFLECTION_PREFIXES),
    )


def internal_token_interceptor(token: SecretFile) -> TokenInterceptor:
    """An executor's port: ``x-pagedserve-internal-token``; health open."""
    return TokenInterceptor(
        token, plain(INTERNAL_TOKEN), f"missing or invalid internal token (metadata {INTERNAL_TOKEN})", (HEALTH_PREFIX,)
    )


def _with_header(client_call_details, header: str, secret: SecretFile):
    metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
    metadata.add(header, secret.first())
    return client_call_details._replace(metadata=metadata)


class TokenClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds ``header: <the file's first secret>`` to every unary call of the executor API; the file
    is reread when it changes, like the server's copy. (grpc.aio files an interceptor under one kind
    of call only: ``TokenStreamInterceptor`` does the same for the ``Steps`` stream.)"""

    def __init__(self, header: str, secret: SecretFile) -> None:
        self.header = header
        self.secret = secret

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_header(client_call_details, self.header, self.secret), request)


class TokenStreamInterceptor(grpc.aio.StreamStreamClientInterceptor):
    """``TokenClientInterceptor`` for bidirectional streams (the pipelined loop's ``Steps``)."""

    def __init__(self, header: str, secret: SecretFile) -> None:
        self.header = header
        self.secret = secret

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_header(client_call_details, self.header, self.secret), request_iterator)


class TokenServerStreamInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    """``TokenClientInterceptor`` for server-streaming calls: a peer executor's ``ReadBlocks`` (KV that
    moves). Without it a reader's pulls reach the source without the token and are refused."""

    def __init__(self, header: str, secret: SecretFile) -> None:
        self.header = header
        self.secret = secret

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_header(client_call_details, self.header, self.secret), request)
