"""``python -m pagedserve.dev.devcerts DIR``: a development CA, certificates and secrets.

Writes, as PEM:

- ``ca.crt``, ``ca.key``: a self-signed CA (the trust root of the deployment);
- ``scheduler.crt``/``.key`` and ``executor.crt``/``.key``: leaf certificates signed
  by it, each good for both serverAuth and clientAuth (a scheduler presents its
  certificate as a server on the public port and as a client to executors), with
  the SANs ``localhost``, ``127.0.0.1``, the service's name (``scheduler`` or
  ``executor``) and each ``--host``;
- ``api-keys``: one random API key (the ``--api-key-file`` format);
- ``internal-token``: a random shared token (``--internal-token-file``).

For development and tests only: the keys are unencrypted files. In production, use
your own CA (cert-manager, Vault, ...). Existing files are overwritten unless
``--keep`` is given, in which case a complete existing set is left alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365
ROLES = ("scheduler", "executor")


@dataclass(frozen=True, slots=True)
class DevCerts:
    """Where ``write`` put each file."""

    dir: Path
    ca_cert: Path
    ca_key: Path
    scheduler_cert: Path
    scheduler_key: Path
    executor_cert: Path
    executor_key: Path
    api_keys: Path
    internal_token: Path

    @classmethod
    def at(cls, directory: str | os.PathLike[str]) -> DevCerts:
        d = Path(directory)
        return cls(
            d,
            d / "ca.crt",
            d / "ca.key",
            d / "scheduler.crt",
            d / "scheduler.key",
            d / "executor.crt",
            d / "executor.key",
            d / "api-keys",
            d / "internal-token",
        )

    def complete(self) -> bool:
        return all(
            p.exists()
            for p in (
                self.ca_cert,
                self.ca_key,
                self.scheduler_cert,
                self.scheduler_key,
                self.executor_cert,
                self.executor_key,
                self.api_keys,
                self.internal_token,
            )
        )


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pagedserve development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(
    common_name: str = "pagedserve development CA", days: int = VALID_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def make_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    hosts: Sequence[str],
    days: int = VALID_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``hosts`` (SANs, deduplicated, in order) good for server and client auth."""
    key = _key()
    now = dt.datetime.now(dt.UTC)
    names = list(dict.fromkeys(hosts))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _write(path: Path, data: bytes, private: bool) -> None:
    """Atomically (a reader never sees half a file), ``0600`` for secrets."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_leaf(
    cert_path: Path,
    key_path: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    hosts: Sequence[str],
) -> None:
    """Write one leaf pair (the key first: a reloading server that sees the new
    certificate finds its key already there)."""
    cert, key = make_leaf(ca_cert, ca_key, common_name, hosts)
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, _cert_pem(cert), private=False)


def write(directory: str | os.PathLike[str], hosts: Sequence[str] = (), keep: bool = False) -> DevCerts:
    """Write the CA, both leaf pairs, an API key file and an internal token under
    ``directory`` (created if needed); returns their paths."""
    out = DevCerts.at(directory)
    out.dir.mkdir(parents=True, exist_ok=True)
    if keep and out.complete():
        return out
    ca_cert, ca_key = make_ca()
    _write(out.ca_key, _key_pem(ca_key), private=True)
    _write(out.ca_cert, _cert_pem(ca_cert), private=False)
    for role in ROLES:
        write_leaf(
            getattr(out, f"{role}_cert"),
            getattr(out, f"{role}_key"),
            ca_cert,
            ca_key,
            role,
            ["localhost", "127.0.0.1", role, *hosts],
        )
    _write(out.api_keys, f"# pagedserve API keys: one per line\n{secrets.token_urlsafe(32)}\n".encode(), private=True)
    _write(out.internal_token, f"{secrets.token_urlsafe(32)}\n".encode(), private=True)
    return out


def load_ca(out: DevCerts) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA ``write`` made, to sign more certificates with (tests rotate leaves with it)."""
    cert = x509.load_pem_x509_certificate(out.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(out.ca_key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pagedserve.dev.devcerts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", type=Path, help="output directory (created if missing)")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME",
        help="an extra DNS name or IP address in both leaf certificates (repeatable), e.g. a compose "
        "service name or the host clients dial",
    )
    p.add_argument("--keep", action="store_true", help="leave a complete existing set as it is")
    args = p.parse_args(argv)
    out = write(args.dir, args.host, args.keep)
    print(f"development CA, certificates, API key and internal token in {out.dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
