"""``pagedserve health``: a probe that speaks TLS; exit 0 when the server reports SERVING."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.security import channel_credentials


def add_parser(sub: argparse._SubParsersAction) -> None:
    h = sub.add_parser("health", help="exit 0 if a scheduler or executor reports SERVING (a probe that speaks TLS)")
    h.add_argument("--address", default="localhost:50051", help="HOST:PORT (default: %(default)s)")
    h.add_argument(
        "--service", default="", help="the health service name (default: the overall status; `liveness`: merely up)"
    )
    h.add_argument("--tls-ca", default=None, metavar="PATH", help="speak TLS, trusting this CA bundle")
    h.add_argument(
        "--tls-cert",
        default=None,
        metavar="PATH",
        help="client certificate, for an executor with --tls-ca (with --tls-key)",
    )
    h.add_argument("--tls-key", default=None, metavar="PATH", help="the key of --tls-cert")
    h.add_argument("--timeout", type=float, default=1.0, help="seconds (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
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
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            sys.stderr.write(f"{args.address}: {exc.code().name}: {exc.details()}\n")
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {name}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
