"""``pagedserve generate``: call the public API from the command line; ``generate()`` from Python.

    pagedserve generate "Write a haiku about paging"                       # chat prompt
    pagedserve generate --raw "The capital of France is" -n 8              # plain completion
    pagedserve generate --address host-a:50051 --address host-b:50051 --json "Hi"
    pagedserve status --json --redis-url redis://localhost:6379/0          # the deployment, once
    pagedserve top --redis-url redis://localhost:6379/0                    # refreshing (pagedserve/status.py)
    pagedserve generate --tls-ca ca.crt --api-key KEY "Hi"                # TLS and an API key (docs/security.md)
    pagedserve health --address localhost:50061 --tls-ca ca.crt --tls-cert c.crt --tls-key c.key  # a probe

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

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import status
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


def generate(addresses: str | Sequence[str], request: pb.GenerateRequest, timeout: float | None = None,
             retries: int = RETRIES, *, api_key: str | None = None,
             tls_ca: str | Path | None = None) -> Iterator[pb.GenerateResponse]:
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
                call = (stub.Resume(pb.ResumeRequest(request_id=req.request_id, offset=have), timeout=timeout,
                                    metadata=metadata)
                        if resume else stub.Generate(req, timeout=timeout, metadata=metadata))
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
            code = exc.code()  # type: ignore[attr-defined]
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


def stream_chat(address: str | Sequence[str], prompt: str, out: TextIO, max_tokens: int = 128, *,
                api_key: str | None = None, tls_ca: str | Path | None = None) -> pb.GenerateResponse:
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=prompt)],
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    last = pb.GenerateResponse()
    for last in generate(address, req, api_key=api_key, tls_ca=tls_ca):
        out.write(last.text)
        out.flush()
    return last


def _as_json(resp: pb.GenerateResponse) -> str:
    return json.dumps({"request_id": resp.request_id, "offset": resp.offset, "token_ids": list(resp.token_ids),
                       "text": resp.text, "finish_reason": resp.finish_reason})


def _health_main(args: argparse.Namespace) -> int:
    if (args.tls_cert is None) != (args.tls_key is None):
        sys.stderr.write("error: --tls-cert and --tls-key go together\n")
        return 2
    try:
        creds = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    channel = grpc.secure_channel(args.address, creds) if creds else grpc.insecure_channel(args.address)
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                             timeout=args.timeout)
        except grpc.RpcError as exc:
            sys.stderr.write(f"{args.address}: {exc.code().name}: {exc.details()}\n")
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {name}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="stream a completion to stdout")
    g.add_argument("prompt")
    g.add_argument("--address", action="append", default=None,
                   help="a scheduler replica HOST:PORT (repeatable: a broken stream resumes on the next; "
                        "default localhost:50051)")
    g.add_argument("--raw", action="store_true", help="plain completion instead of a chat message")
    g.add_argument("--json", action="store_true",
                   help="one JSON object per response: request_id, offset, token_ids, text, finish_reason")
    g.add_argument("--request-id", default="", help="default: a random one (needed to resume)")
    g.add_argument("-n", "--max-tokens", type=int, default=128)
    g.add_argument("-t", "--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--priority", type=int, default=0)
    g.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="sent as authorization: Bearer KEY (default: $PAGEDSERVE_API_KEY)")
    g.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="speak TLS, trusting this CA bundle (PEM) for the scheduler's certificate")


def _health_parser(sub: argparse._SubParsersAction) -> None:
    h = sub.add_parser("health", help="exit 0 if a scheduler or executor reports SERVING (a probe that speaks TLS)")
    h.add_argument("--address", default="localhost:50051", help="HOST:PORT (default: %(default)s)")
    h.add_argument("--service", default="", help="the health service name (default: the overall status; "
                                                   "`liveness`: merely up)")
    h.add_argument("--tls-ca", default=None, metavar="PATH", help="speak TLS, trusting this CA bundle")
    h.add_argument("--tls-cert", default=None, metavar="PATH",
                   help="client certificate, for an executor with --tls-ca (with --tls-key)")
    h.add_argument("--tls-key", default=None, metavar="PATH", help="the key of --tls-cert")
    h.add_argument("--timeout", type=float, default=1.0, help="seconds (default: %(default)s)")


def _status_parsers(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("status", help="the deployment as Redis holds it: executors, queue, replicas (once)")
    status.add_arguments(st, interval=None)
    st.add_argument("--json", action="store_true", help="one JSON object (top-level key `executors`), for scripts")
    tp = sub.add_parser("top", help="the deployment as Redis holds it, refreshing until Ctrl-C")
    status.add_arguments(tp, interval=1.0)
    tp.add_argument("--once", action="store_true", help="print one frame and exit")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve", description="Client for a pagedserve deployment.")
    sub = p.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _health_parser(sub)
    _status_parsers(sub)
    return p


def _request_of(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    req = pb.GenerateRequest(request_id=args.request_id, sampling=sampling, priority=args.priority)
    if args.raw:
        req.prompt = args.prompt
    else:
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    return req


def _generate_main(args: argparse.Namespace) -> int:
    try:
        for resp in generate(args.address or ["localhost:50051"], _request_of(args), api_key=args.api_key,
                             tls_ca=args.tls_ca):
            if args.json:
                print(_as_json(resp), flush=True)
                continue
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.finish_reason:
                sys.stdout.write("\n")
                sys.stderr.write(f"[{resp.finish_reason}: {resp.prompt_tokens} prompt + "
                                 f"{resp.completion_tokens} completion tokens]\n")
    except grpc.RpcError as exc:
        sys.stderr.write(f"error: {exc.code().name}: {exc.details()}\n")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.command == "health":
        return _health_main(args)
    if args.command in ("status", "top"):
        if not args.redis_url:
            p.error("--redis-url (or $REDIS_URL) is required")
        return status.status_main(args) if args.command == "status" else status.top_main(args)
    return _generate_main(args)


if __name__ == "__main__":
    sys.exit(main())
