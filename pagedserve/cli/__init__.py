"""The ``pagedserve`` command: a client for a deployment.

pagedserve generate "Write a haiku about paging"                       # chat prompt
pagedserve generate --raw "The capital of France is" -n 8              # plain completion
pagedserve generate --address host-a:50051 --address host-b:50051 --json "Hi"
pagedserve status --json --redis-url redis://localhost:6379/0          # the deployment, once
pagedserve top --redis-url redis://localhost:6379/0                    # refreshing (pagedserve/cli/status.py)
pagedserve generate --tls-ca ca.crt --api-key KEY "Hi"                # TLS and an API key (docs/security.md)
pagedserve health --address localhost:50061 --tls-ca ca.crt --tls-cert c.crt --tls-key c.key  # a probe
"""

from __future__ import annotations

import argparse
import sys

from pagedserve.cli import generate, health, status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve", description="Client for a pagedserve deployment.")
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    health.add_parser(sub)
    status.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.command == "health":
        return health.run(args)
    if args.command in ("status", "top"):
        if not args.redis_url:
            p.error("--redis-url (or $REDIS_URL) is required")
        if args.command == "status":
            return status.status_main(args)
        from pagedserve.cli import top  # rich, only when drawing

        return top.top_main(args)
    return generate.run(args)


if __name__ == "__main__":
    sys.exit(main())
