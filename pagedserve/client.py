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
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
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
    """Stream one request, each token exactly once, across replica failures and drains.

    On UNAVAILABLE it reconnects (the same address first, then the next one) and
    resumes from the last offset delivered; other errors are raised (UNAUTHENTICATED:
    no or a wrong ``api_key``). ``tls_ca``: speak TLS, trusting this CA bundle.
    """
    metadata = auth_metadata(api_key)
    addrs = [addresses] if isinstance(addresses, str) else list(addresses)
    req = pb.GenerateRequest()
    req.CopyFrom(request)
    req.request_id = req.request_id or uuid.uuid4().hex
    have, resume, failures, i = 0, False, 0, 0
    while True:
        try:
            with open_channel(addrs[i % len(addrs)], tls_ca) as channel:
                stub = pb_grpc.GenerationStub(channel)
                call = (
                    stub.Resume(
                        pb.ResumeRequest(request_id=req.request_id, offset=have), timeout=timeout, metadata=metadata
                    )
                    if resume
                    else stub.Generate(req, timeout=timeout, metadata=metadata)
                )
                for resp in call:
                    failures = 0
                    fresh = _fresh(resp, have)
                    if fresh is None:
                        continue
                    have = fresh.offset + len(fresh.token_ids)
                    yield fresh
                    if fresh.finish_reason:
                        return
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND and resume and have == 0:
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
