"""TLS for both services: server credentials that reload, and how schedulers dial executors.

Server side, ``ReloadingCertificate`` hands gRPC a certificate-configuration
fetcher (``grpc.dynamic_ssl_server_credentials``): gRPC calls it at every new
connection's handshake, and it returns a new configuration when the
certificate, key or CA file changed (mtime, size or inode) or after SIGHUP.
Established connections keep the certificate they were made with; new ones
get the new one, with no restart. A half-replaced pair (a key that does not
match the certificate, a file that does not parse) is not loaded: the current
one stays until the files are consistent again. ``ReloadingSSLContext`` does the same
for the scheduler's HTTPS port (an ``ssl.SSLContext`` for uvicorn).

With a client CA (``--tls-ca`` on an executor) the handshake requires a client
certificate signed by it: the TLS layer, not the handler, turns away whoever
has none.

Client side, ``Dialer`` builds the scheduler's channels to executors: TLS
verifying the executor's certificate against ``--tls-ca`` and presenting the
scheduler's own pair as the client certificate, and/or the internal token in
the metadata. Credentials are read from the files for each new channel, so a
rotated client certificate is used from the next connection on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from pagedserve import rpc
from pagedserve.auth import (
    INTERNAL_TOKEN,
    SecretFile,
    TokenClientInterceptor,
    TokenServerStreamInterceptor,
    TokenStreamInterceptor,
)

log = logging.getLogger(__name__)


def read_pem(path: Path | str, what: str) -> bytes:
    """The file's bytes, or ValueError naming the flag if missing, unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {path} is not a PEM file")
    return data


def check_pair(cert_pem: bytes, key_pem: bytes, cert_path: Path, key_path: Path) -> None:
    """ValueError unless the key is the certificate's (and both parse)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise ValueError(f"--tls-cert: {cert_path}: not a certificate: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--tls-key: {key_path}: not an unencrypted private key: {exc}") from exc
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise ValueError(f"--tls-key: {key_path} is not the key of the certificate in {cert_path}")


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` as given (any may be None)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @classmethod
    def from_args(cls, args: object) -> TLSFiles:
        get = lambda name: Path(v) if (v := getattr(args, name, None)) else None  # noqa: E731
        return cls(get("tls_cert"), get("tls_key"), get("tls_ca"))

    def problem(self) -> str | None:
        """What is wrong with the combination and files, for ``argparse``'s ``error``; None if fine."""
        if (self.cert is None) != (self.key is None):
            return "--tls-cert and --tls-key go together"
        try:
            if self.cert is not None and self.key is not None:
                check_pair(read_pem(self.cert, "--tls-cert"), read_pem(self.key, "--tls-key"), self.cert, self.key)
            if self.ca is not None:
                x509.load_pem_x509_certificates(read_pem(self.ca, "--tls-ca"))
        except ValueError as exc:
            return str(exc).splitlines()[0]
        return None


class Reloadable(Protocol):
    def request_reload(self) -> None: ...


class ReloadingCertificate:
    """Server credentials from ``cert``/``key`` (and a client CA, which makes client
    certificates required), reloaded as the module docstring says."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        self.cert, self.key, self.client_ca = Path(cert), Path(key), client_ca and Path(client_ca)
        self._stamp = self._stat()
        self._force = False
        self._failed: object = None
        self._initial = self._config()

    def _paths(self) -> list[Path]:
        return [self.cert, self.key, *([self.client_ca] if self.client_ca else [])]

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in map(os.stat, self._paths()))

    def _config(self) -> grpc.ServerCertificateConfiguration:
        cert_pem, key_pem = read_pem(self.cert, "--tls-cert"), read_pem(self.key, "--tls-key")
        check_pair(cert_pem, key_pem, self.cert, self.key)
        ca_pem = read_pem(self.client_ca, "--tls-ca") if self.client_ca else None
        if ca_pem is not None:
            x509.load_pem_x509_certificates(ca_pem)
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=ca_pem)

    def request_reload(self) -> None:
        self._force = True

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration, or None to keep the current one. Never raises
        (it runs inside the handshake)."""
        try:
            stamp = self._stat()
            if stamp == self._stamp and not self._force:
                return None
            config = self._config()
        except (OSError, ValueError) as exc:
            if self._failed != str(exc):
                log.error("TLS certificate not reloaded, keeping the current one: %s", exc)
                self._failed = str(exc)
            return None
        self._stamp, self._force, self._failed = stamp, False, None
        log.info("TLS certificate reloaded from %s", self.cert)
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=self.client_ca is not None
        )


class ReloadingSSLContext:
    """The HTTPS port's ``ssl.SSLContext`` (``context``), reloaded as ``ReloadingCertificate``
    is: at every handshake its ``sni_callback`` (OpenSSL calls it for every ClientHello, with
    or without a server name) swaps in a context loaded afresh when ``cert`` or ``key``
    changed (mtime, size or inode) or after SIGHUP. A pair that does not load (a key that is
    not the certificate's, a half-written file) leaves the current one in place."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = Path(cert), Path(key)
        self._stamp = self._stat()
        self._force = False
        self._failed: str | None = None
        self._current = self._load()
        self.context = self._load()
        self.context.sni_callback = self._on_hello

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in map(os.stat, (self.cert, self.key)))

    def _load(self) -> ssl.SSLContext:
        check_pair(read_pem(self.cert, "--tls-cert"), read_pem(self.key, "--tls-key"), self.cert, self.key)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)  # checks the pair again: the files may have changed since
        except ssl.SSLError as exc:
            raise ValueError(f"--tls-cert/--tls-key: {self.cert}, {self.key}: {exc}") from exc
        return ctx

    def request_reload(self) -> None:
        self._force = True

    def current(self) -> ssl.SSLContext:
        """The context new connections get, reloaded first if the files changed. Never raises."""
        try:
            stamp = self._stat()
            if stamp == self._stamp and not self._force:
                return self._current
            fresh = self._load()
        except (OSError, ValueError) as exc:
            if self._failed != str(exc):
                log.error("HTTPS certificate not reloaded, keeping the current one: %s", exc)
                self._failed = str(exc)
            return self._current
        self._current, self._stamp, self._force, self._failed = fresh, stamp, False, None
        log.info("HTTPS certificate reloaded from %s", self.cert)
        return fresh

    def _on_hello(self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        conn.context = self.current()


def server_tls(files: TLSFiles, verify_clients: bool) -> ReloadingCertificate | None:
    """The port's certificate if ``--tls-cert`` is set; ``verify_clients``: require client
    certificates signed by ``--tls-ca`` (executors), else the CA is not used here (schedulers)."""
    if files.cert is None or files.key is None:
        return None
    return ReloadingCertificate(files.cert, files.key, files.ca if verify_clients else None)


def channel_credentials(
    ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """Trust ``ca`` (None: the system's roots) and, given a pair, present it as the client certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "--tls-ca") if ca else None,
        private_key=read_pem(key, "--tls-key") if key else None,
        certificate_chain=read_pem(cert, "--tls-cert") if cert else None,
    )


class Dialer:
    """How a scheduler reaches executors: TLS when ``tls.ca`` is set (with ``tls.cert``/``key``
    as the client certificate), and the internal token in every call's metadata when
    ``token`` is set. ``server_name``: the name expected in executors' certificates when it
    is not the host in their address (e.g. they register pod IPs, the certificate says
    ``executor``).

    The files are reread for a new channel when they changed; while they cannot be read
    (mid-rotation), the last good credentials are used."""

    def __init__(
        self, tls: TLSFiles = TLSFiles(), token: SecretFile | None = None, server_name: str | None = None
    ) -> None:
        self.tls, self.token, self.server_name = tls, token, server_name
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._creds: grpc.ChannelCredentials | None = None
        if tls.ca is not None:
            self._credentials()  # fail at start, not at the first executor

    def _credentials(self) -> grpc.ChannelCredentials:
        paths = [p for p in (self.tls.ca, self.tls.cert, self.tls.key) if p is not None]
        try:
            stamp = tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in map(os.stat, paths))
            if self._creds is None or stamp != self._stamp:
                self._creds = channel_credentials(self.tls.ca, self.tls.cert, self.tls.key)
                if self._stamp is not None:
                    log.info("client TLS credentials reloaded from %s", ", ".join(map(str, paths)))
                self._stamp = stamp
        except (OSError, ValueError) as exc:
            if self._creds is None:
                raise ValueError(str(exc)) from exc
            log.error("client TLS credentials not reloaded, keeping the current ones: %s", exc)
        return self._creds

    def channel(self, address: str) -> grpc.aio.Channel:
        options: list[tuple[str, str | int]] = list(rpc.CHANNEL_OPTIONS)
        interceptors = None
        if self.token:  # unary calls, the Steps stream, ReadBlocks (grpc.aio files an interceptor under one kind)
            interceptors = [
                TokenClientInterceptor(INTERNAL_TOKEN, self.token),
                TokenStreamInterceptor(INTERNAL_TOKEN, self.token),
                TokenServerStreamInterceptor(INTERNAL_TOKEN, self.token),
            ]
        if self.tls.ca is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(address, self._credentials(), options=options, interceptors=interceptors)


def insecure(address: str) -> grpc.aio.Channel:
    """The default dialer: plaintext, no token."""
    return grpc.aio.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)


DialFn = Callable[[str], grpc.aio.Channel]


def reload_on_sighup(reloadables: Iterable[Reloadable | None]) -> None:
    """SIGHUP rereads certificates and secret files at their next use (without it, a file
    change is noticed anyway; the signal is for when mtimes cannot be trusted). Installed
    always, so that SIGHUP never kills a service."""
    items = [r for r in reloadables if r is not None]

    def reload() -> None:
        log.info("SIGHUP: reloading %d certificate/secret file set(s) at next use", len(items))
        for item in items:
            item.request_reload()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
