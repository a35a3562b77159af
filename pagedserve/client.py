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

    def resumes(self, request_id: str) -> list[pb.ResumeRequest]:
        """One ``Resume`` per unfinished completion, from its own offset (no index without ``n``)."""
        if self.n == 1:
            return [pb.ResumeRequest(request_id=request_id, offset=self.have[0])]
        return [
            pb.ResumeRequest(request_id=request_id, offset=self.have[i], index=i)
            for i in range(self.n)
            if i not in self.done
        ]


def open_channel(address: str, tls_ca: str | Path | None = None) -> grpc.Channel:
    """A channel to a scheduler: TLS trusting ``tls_ca`` if given, else plaintext."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, channel_credentials(Path(tls_ca)), options=CHANNEL_OPTIONS)


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    return [(AUTHORIZATION, f"Bearer {api_key}")] if api_key else []


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
    unfinished completion from the last offset it delivered of it; other errors are raised
    (UNAUTHENTICATED: no or a wrong ``api_key``). ``tls_ca``: speak TLS, trusting this CA bundle.
    """
    metadata = auth_metadata(api_key)
    addrs = [addresses] if isinstance(addresses, str) else list(addresses)
    req = pb.GenerateRequest()
    req.CopyFrom(request)
    req.request_id = req.request_id or uuid.uuid4().hex
    got = Progress(req.sampling.n if req.sampling.HasField("n") else 1)
    resume, failures, i = False, 0, 0
    while True:
        try:
            with open_channel(addrs[i % len(addrs)], tls_ca) as channel:
                stub = pb_grpc.GenerationStub(channel)
                calls = (
                    [stub.Resume(r, timeout=timeout, metadata=metadata) for r in got.resumes(req.request_id)]
                    if resume
                    else [stub.Generate(req, timeout=timeout, metadata=metadata)]
                )
                for resp in _merged(calls):
                    failures = 0
                    fresh = got.take(resp)
                    if fresh is not None:
                        yield fresh
                    if got.finished:
                        return
                resume = True  # the streams ended before every completion did: ask for the rest
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND and resume and not got.started:
                resume = False  # it never got in: submit it
                continue
            if code == grpc.StatusCode.ALREADY_EXISTS and not resume:
                resume = True  # an earlier attempt got in after all
                continue
            if code != grpc.StatusCode.UNAVAILABLE or failures >= retries:
                raise
            failures += 1
            resume = True
            if failures > 1:
                i += 1  # the same address once more (a restart), then the next
            time.sleep(min(2.0, BACKOFF_S * 2 ** (failures - 1)))


_END = object()


def _merged(calls: list[grpc.Call]) -> Iterator[pb.GenerateResponse]:
    """The responses of several server streams as they come (one ``Resume`` per completion), each
    read on a thread of its own; the first error ends them all and is raised. One call is read
    here directly."""
    if len(calls) == 1:
        yield from calls[0]
        return
    out: queue.Queue[object] = queue.Queue()

    def pump(call: grpc.Call) -> None:
        try:
            for resp in call:
                out.put(resp)
        except grpc.RpcError as exc:
            out.put(exc)
        finally:
            out.put(_END)

    threads = [threading.Thread(target=pump, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    try:
        ended = 0
        while ended < len(calls):
            item = out.get()
            if item is _END:
                ended += 1
            elif isinstance(item, grpc.RpcError):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        for c in calls:
            c.cancel()
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
