"""gRPC health check for container probes, with or without TLS; exits 0 only when SERVING.

    python scripts/healthcheck.py [--service NAME] [TLS options] PORT

Kubernetes' native gRPC probes and compose's plain checks speak no TLS, so once a
port serves TLS (mutual TLS on the executor's) the probe is this script:

- ``--tls-ca CA [--tls-cert CERT --tls-key KEY]``: verify the server against CA,
  presenting CERT as the client certificate (an executor with ``--tls-ca`` accepts
  only those; the pod's own certificate is one, valid for clientAuth);
- ``--certs DIR --role scheduler|executor``: the same with ``DIR/ca.crt`` and
  ``DIR/ROLE.crt``/``.key`` when all three exist, plaintext otherwise (compose, where
  ``certs/`` is optional);
- ``--server-name NAME``: the name the certificate must carry (default: 127.0.0.1,
  which the dev certificates include; the k8s manifests pass the service's name).

Health needs no API key and no internal token. Only grpcio and grpc_health are
imported, so the probe stays cheap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.split("\n\n")[0])
    p.add_argument("port", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--service", default="", help="health service to ask (default: the overall status)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--tls-ca", type=Path, default=None)
    p.add_argument("--tls-cert", type=Path, default=None)
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--certs", type=Path, default=None, help="a dev-certs directory, used when complete")
    p.add_argument("--role", choices=("scheduler", "executor"), default=None)
    p.add_argument("--server-name", default=None)
    args = p.parse_args(argv)
    if args.certs is not None:
        if args.role is None:
            p.error("--certs needs --role")
        files = [args.certs / "ca.crt", args.certs / f"{args.role}.crt", args.certs / f"{args.role}.key"]
        if all(f.is_file() for f in files):
            args.tls_ca, args.tls_cert, args.tls_key = files
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    return args


def channel(args: argparse.Namespace) -> grpc.Channel:
    target = f"{args.host}:{args.port}"
    if args.tls_ca is None:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=args.tls_ca.read_bytes(),
        private_key=args.tls_key.read_bytes() if args.tls_key else None,
        certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(target, creds, options=options)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with channel(args) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                        timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"health check on port {args.port}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"health check on port {args.port}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
