"""The Secrets the k8s manifests mount, as YAML on stdout:

    python scripts/k8s-secrets.py certs/ | kubectl apply -f -      # from a dev-certs directory
    python scripts/k8s-secrets.py --placeholders                    # k8s/examples/secrets.yaml

From DIR (the layout ``python -m pagedserve.dev.devcerts DIR`` writes: ca.crt,
scheduler.crt/.key, executor.crt/.key, api-keys, internal-token) it builds:

- ``pagedserve-scheduler-tls`` and ``pagedserve-executor-tls`` (kubernetes.io/tls:
  tls.crt, tls.key, ca.crt);
- ``pagedserve-api-keys`` (api-keys: one key per line, several during a rotation);
- ``pagedserve-internal-token`` (internal-token);
- ``pagedserve-redis`` (password: ``--redis-password``, else 32 random bytes as hex; it
  goes into ``redis://:PASSWORD@...`` so it must be URL-safe).

With ``--placeholders`` every value is a ``REPLACE-ME`` marker instead: the example
committed in k8s/examples/secrets.yaml, which is not a working configuration.
Production certificates come from your own CA (cert-manager, Vault, ...), with the
same Secret names and keys.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from pathlib import Path

import yaml

PLACEHOLDER = "REPLACE-ME"
# Secret name -> (component label, type, {key in the Secret: file in DIR})
SECRETS: dict[str, tuple[str, str, dict[str, str]]] = {
    "pagedserve-scheduler-tls": ("scheduler", "kubernetes.io/tls",
                                 {"tls.crt": "scheduler.crt", "tls.key": "scheduler.key", "ca.crt": "ca.crt"}),
    "pagedserve-executor-tls": ("executor", "kubernetes.io/tls",
                                {"tls.crt": "executor.crt", "tls.key": "executor.key", "ca.crt": "ca.crt"}),
    "pagedserve-api-keys": ("scheduler", "Opaque", {"api-keys": "api-keys"}),
    "pagedserve-internal-token": ("scheduler", "Opaque", {"internal-token": "internal-token"}),
    "pagedserve-redis": ("redis", "Opaque", {"password": ""}),
}
URL_SAFE = re.compile(r"[A-Za-z0-9._~-]+")


class Literal(str):
    """Dumped as a YAML block literal (PEM stays readable)."""


yaml.SafeDumper.add_representer(
    Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def placeholder(secret: str, key: str) -> str:
    return f"{PLACEHOLDER}: {key} of {secret} (scripts/k8s-secrets.py DIR writes real ones)"


def build(directory: Path | None, redis_password: str | None) -> list[dict]:
    docs = []
    for name, (component, kind, keys) in SECRETS.items():
        data = {}
        for key, filename in keys.items():
            if directory is None:
                value = placeholder(name, key)
            elif name == "pagedserve-redis":
                value = redis_password or secrets.token_hex(32)
            else:
                value = (directory / filename).read_text()
            data[key] = Literal(value)
        docs.append({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "pagedserve",
                                                  "app.kubernetes.io/component": component,
                                                  "app.kubernetes.io/part-of": "pagedserve"}},
            "type": kind,
            "stringData": data,
        })
    return docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k8s-secrets.py", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", type=Path, help="a dev-certs directory")
    p.add_argument("--redis-password", default=None, help="default: 32 random bytes as hex")
    p.add_argument("--placeholders", action="store_true", help="REPLACE-ME values instead of files")
    args = p.parse_args(argv)
    if (args.dir is None) != args.placeholders:
        p.error("give a dev-certs DIR, or --placeholders")
    if args.redis_password is not None and not URL_SAFE.fullmatch(args.redis_password):
        p.error("--redis-password must be URL-safe (letters, digits, . _ ~ -): it goes into REDIS_URL")
    try:
        docs = build(args.dir, args.redis_password)
    except OSError as e:
        p.error(f"{e.filename}: {e.strerror} (python -m pagedserve.dev.devcerts DIR writes the files)")
    header = "# Secrets for k8s/ (scripts/k8s-secrets.py)."
    if args.placeholders:
        header += (f"\n# EXAMPLE ONLY: every value is a {PLACEHOLDER} placeholder. Create real ones with\n"
                   "#   python -m pagedserve.dev.devcerts certs/ && python scripts/k8s-secrets.py certs/ | kubectl apply -f -\n"
                   "# or from your own CA with these names and keys (docs/deploy.md, \"Secrets\").")
    sys.stdout.write(header + "\n" + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True, width=200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
