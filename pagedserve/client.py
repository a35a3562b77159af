"""The resuming client: ``generate()`` streams a completion and survives the replica behind it.

The command line (``pagedserve generate``, ``status``, ``top``, ``health``) is ``pagedserve.cli``.
A stream survives the replica behind it. The protocol, for clients in other
languages too (see ``protos/pagedserve/v1/generation.proto``):
1. send ``Generate`` with a ``request_id`` of your own;
2. keep, from each response, the tokens from the offset you expect on
   (``offset`` is the index in the completion of its first token);
3. on UNAVAILABLE (the replica crashed, or drains: its trailing metadata then
   says ``pagedserve-request-id`` and ``pagedserve-offset``), call ``Resume``
   with the id and the number of tokens you have, on the same address or any
   other replica; NOT_FOUND before any token means the request never got in:
   send ``Generate`` again.
With ``sampling.n`` > 1 the messages of the n completions interleave, each
carrying its ``index``: keep an offset per index, the stream is over when every
completion has sent its ``finish_reason``, and resume each unfinished one from
its own offset (``Resume.index``).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc

from pagedserve.auth import AUTHORIZATION
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.security import channel_credentials
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

RETRIES = 8  # consecutive failed attempts before giving up
BACKOFF_S = 0.2  # doubled per consecutive failure, at most 2 s


def _fresh(resp: pb.GenerateResponse, have: int) -> pb.GenerateResponse | None:
    """``resp`` without the tokens the caller already has; None if it brings nothing new."""
    if resp.offset > have:
        raise RuntimeError(f"{resp.request_id}: the server skipped tokens {have}..{resp.offset}")
    overlap = have - resp.offset
    if overlap == 0:
        return resp
    if overlap >= len(resp.token_ids) and not resp.finish_reason:
        return None
    trimmed = pb.GenerateResponse()
    trimmed.CopyFrom(resp)
    del trimmed.token_ids[:overlap]
    trimmed.offset = have
    return trimmed


@dataclass(slots=True)
class Progress:
    """What the caller has of each completion of one request: tokens per ``index``, and which ended."""

    n: int = 1
    have: list[int] = field(default_factory=list)
    done: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.have = self.have or [0] * self.n

    def take(self, resp: pb.GenerateResponse) -> pb.GenerateResponse | None:
        """``resp`` without what the caller has (None if nothing new); a completion that ended
        says nothing more."""
        if resp.index >= self.n:
            raise RuntimeError(f"{resp.request_id}: completion {resp.index} of a request with n={self.n}")
        if resp.index in self.done:
            return None
        fresh = _fresh(resp, self.have[resp.index])
        if fresh is not None:
            self.have[resp.index] = fresh.offset + len(fresh.token_ids)
            if fresh.finish_reason:
                self.done.add(resp.index)
        return fresh

    @property
    def finished(self) -> bool:
        return len(self.done) == self.n

    @property
    def started(self) -> bool:
        return any(self.have) or bool(self.done)

    def unfinished(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.done]

    def resume(self, request_id: str, index: int) -> pb.ResumeRequest:
        """The ``Resume`` of completion ``index`` from what the caller has of it (no index without ``n``)."""
        if self.n == 1:
            return pb.ResumeRequest(request_id=request_id, offset=self.have[0])
        return pb.ResumeRequest(request_id=request_id, offset=self.have[index], index=index)


def open_channel(address: str, tls_ca: str | Path | None = None) -> grpc.Channel:
    """A channel to a scheduler: TLS trusting ``tls_ca`` if given, else plaintext."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, channel_credentials(Path(tls_ca)), options=CHANNEL_OPTIONS)


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    return [(AUTHORIZATION, f"Bearer {api_key}")] if api_key else []


class _Resubmit(Exception):
    """NOT_FOUND before any token: the request never got in, so it is sent again."""


@dataclass(slots=True)
class _Attempts:
    """One caller's reconnection state: the address it is on, consecutive failures, the backoff."""

    addresses: list[str]
    retries: int
    i: int = 0
    failures: int = 0

    @property
    def address(self) -> str:
        return self.addresses[self.i % len(self.addresses)]

    def ok(self) -> None:
        self.failures = 0

    def failed(self, exc: grpc.RpcError) -> None:
        """After UNAVAILABLE: wait, then try the same address once more (a restart), then the next;
        any other error, or ``retries`` failures in a row, is raised."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or self.failures >= self.retries:
            raise exc
        self.failures += 1
        if self.failures > 1:
            self.i += 1
        time.sleep(min(2.0, BACKOFF_S * 2 ** (self.failures - 1)))


@dataclass(slots=True)
class _Call:
    """What one stream of the request needs: where, with what credentials, until when."""

    tls_ca: str | Path | None
    metadata: list[tuple[str, str]]
    timeout: float | None


def generate(
    addresses: str | Sequence[str],
    request: pb.GenerateRequest,
    timeout: float | None = None,
    retries: int = RETRIES,
    *,
    api_key: str | None = None,
    tls_ca: str | Path | None = None,
) -> Iterator[pb.GenerateResponse]:
    """Stream one request, each token of each completion exactly once, across replica failures
    and drains; it ends when every completion (``sampling.n`` of them) has sent its finish_reason.

    On UNAVAILABLE it reconnects (the same address first, then the next one) and resumes each
    unfinished completion from the last offset it delivered of it, each on a stream of its own, so
    that one completion's failure never touches another's stream (cancelling a stream aborts its
    completion on the server); other errors are raised (UNAUTHENTICATED: no or a wrong ``api_key``).
    ``tls_ca``: speak TLS, trusting this CA bundle.
    """
    call = _Call(tls_ca, auth_metadata(api_key), timeout)
    addrs = [addresses] if isinstance(addresses, str) else list(addresses)
    req = pb.GenerateRequest()
    req.CopyFrom(request)
    req.request_id = req.request_id or uuid.uuid4().hex
    got = Progress(req.sampling.n if req.sampling.HasField("n") else 1)
    attempts = _Attempts(addrs, retries)
    resume = False
    while not got.finished:
        if resume:
            try:
                yield from _resume_all(req.request_id, got, call, attempts)  # raises what it cannot recover from
            except _Resubmit:
                resume = False
            continue
        try:
            yield from _submit(req, got, call, attempts)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:  # else an earlier attempt got in after all
                attempts.failed(exc)
        resume = True  # the stream ended (a drain) or failed before every completion did: it may have got in


def _submit(req: pb.GenerateRequest, got: Progress, call: _Call, attempts: _Attempts) -> Iterator[pb.GenerateResponse]:
    """One ``Generate`` stream, until every completion has ended or the stream does."""
    with open_channel(attempts.address, call.tls_ca) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for resp in stub.Generate(req, timeout=call.timeout, metadata=call.metadata):
            attempts.ok()
            if (fresh := got.take(resp)) is not None:
                yield fresh
            if got.finished:
                return


def _follow(
    request_id: str, i: int, got: Progress, call: _Call, attempts: _Attempts, live: _Live
) -> Iterator[pb.GenerateResponse]:
    """Resume completion ``i`` from what the caller has of it, again after each failure, until it has ended;
    raises _Resubmit on NOT_FOUND before any token."""
    while i not in got.done and not live.stopped:
        try:
            with open_channel(attempts.address, call.tls_ca) as channel:
                resume = got.resume(request_id, i)
                stream = pb_grpc.GenerationStub(channel).Resume(resume, timeout=call.timeout, metadata=call.metadata)
                live.calls[i] = stream
                for resp in stream:
                    attempts.ok()
                    yield resp
                    if resp.finish_reason:
                        return
        except grpc.RpcError as exc:
            if live.stopped:
                return
            if exc.code() == grpc.StatusCode.NOT_FOUND and not got.started:
                raise _Resubmit() from exc
            attempts.failed(exc)
        finally:
            live.calls.pop(i, None)


@dataclass(slots=True)
class _Live:
    """The Resume streams open at once (one per completion), to cancel when the caller is done."""

    calls: dict[int, grpc.Call] = field(default_factory=dict)
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True
        for c in list(self.calls.values()):
            c.cancel()


_END = object()


def _resume_all(request_id: str, got: Progress, call: _Call, attempts: _Attempts) -> Iterator[pb.GenerateResponse]:
    """Every unfinished completion resumed on a stream of its own (one without ``n``), each read on a thread of its
    own with its own reconnections; the first error that is not recovered ends them all and is raised."""
    live = _Live()
    if got.n == 1:
        for resp in _follow(request_id, 0, got, call, attempts, live):
            if (fresh := got.take(resp)) is not None:
                yield fresh
        return
    out: queue.Queue[object] = queue.Queue()

    def pump(index: int) -> None:
        own = _Attempts(attempts.addresses, attempts.retries, attempts.i)
        try:
            for resp in _follow(request_id, index, got, call, own, live):
                out.put(resp)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out.put(exc)
        finally:
            out.put(_END)

    threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(got.n) if i not in got.done]
    for t in threads:
        t.start()
    try:
        ended = 0
        while ended < len(threads):
            item = out.get()
            if item is _END:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            elif (fresh := got.take(item)) is not None:  # type: ignore[arg-type]
                yield fresh
    finally:
        live.stop()
        for t in threads:
            t.join(timeout=5)


def stream_chat(
    address: str | Sequence[str],
    prompt: str,
    out: TextIO,
    max_tokens: int = 128,
    *,
    api_key: str | None = None,
    tls_ca: str | Path | None = None,
) -> pb.GenerateResponse:
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=prompt)],
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    last = pb.GenerateResponse()
    for last in generate(address, req, api_key=api_key, tls_ca=tls_ca):
        out.write(last.text)
        out.flush()
    return last
