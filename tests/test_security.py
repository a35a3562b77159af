"""TLS, mutual TLS, API keys and the internal token on a real deployment (tiny Llama,
real Redis, real gRPC over sockets, certificates from ``pagedserve.dev.devcerts``):
a call without a key is UNAUTHENTICATED and either of two keys is served; health
and reflection stay open; a plaintext client cannot talk to a TLS port; an
executor turns away whoever lacks a client certificate from its CA (a scheduler
holding a foreign one never gets its tokenizer, let alone steps it), and calls
without the internal token; certificates reload without a restart. Plus the
pure parts (secret files, bearer parsing, the certificate fetcher) without
processes."""

from __future__ import annotations

import os
import signal
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.auth import INTERNAL_TOKEN, SecretFile, bearer, parse_secrets
from pagedserve.cli import main as client_main
from pagedserve.client import generate
from pagedserve.dev import devcerts
from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import grpc_healthy, wait_until
from pagedserve.executor.v1 import executor_pb2 as epb
from pagedserve.executor.v1 import executor_pb2_grpc as epb_grpc
from pagedserve.rpc import CHANNEL_OPTIONS, LIVENESS, PUBLIC_MAX_MESSAGE_BYTES
from pagedserve.security import ReloadingCertificate, TLSFiles, channel_credentials
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import make_cluster
from tests.helpers import greedy

NS = "secure"
PROMPT = list(range(200, 230))
MAX_TOKENS = 12
KEYS = ("first-key-aaaaaaaaaaaaaaaaaaaaaaaa", "second-key-bbbbbbbbbbbbbbbbbbbbbbb")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> devcerts.DevCerts:
    out = devcerts.write(tmp_path_factory.mktemp("certs"))
    out.api_keys.write_text(f"# two keys during a rotation\n{KEYS[0]}\n\n  {KEYS[1]}  \n")
    return out


@pytest.fixture(scope="module")
def secure(
    tiny_llama: Path, redis_url: str, certs: devcerts.DevCerts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """TLS on the public port, mutual TLS and the internal token to the executor, API keys."""
    with make_cluster(
        tiny_llama,
        redis_url,
        NS,
        tmp_path_factory.mktemp("logs"),
        tls=certs,
        api_key_file=certs.api_keys,
        internal_token_file=certs.internal_token,
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[int]:
    from tests.test_e2e_oracle import hf_greedy

    return hf_greedy(tiny_llama, [PROMPT], [MAX_TOKENS])[0]


@pytest.fixture()
def stub(secure: Cluster) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.secure_channel(secure.address, secure.credentials, options=CHANNEL_OPTIONS) as ch:
        yield pb_grpc.GenerationStub(ch)


def _served_cert_serial(address: str, ca: Path, client: tuple[Path, Path] | None = None) -> int:
    """The serial number of the certificate a new connection to ``address`` is shown."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["h2"])
    if client:
        ctx.load_cert_chain(str(client[0]), str(client[1]))
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


# --- the public port -------------------------------------------------------------


def test_without_a_key_every_method_is_unauthenticated(stub: pb_grpc.GenerationStub) -> None:
    calls = {
        "Generate": lambda md: list(stub.Generate(greedy(PROMPT, 2), timeout=30, metadata=md)),
        "Resume": lambda md: list(stub.Resume(pb.ResumeRequest(request_id="x"), timeout=30, metadata=md)),
        "Abort": lambda md: stub.Abort(pb.AbortRequest(request_id="x"), timeout=30, metadata=md),
    }
    for name, call in calls.items():
        for md in (
            [],
            [("authorization", "Bearer not-a-key")],
            [("authorization", f"Basic {KEYS[0]}")],
            [("authorization", f"Bearer {KEYS[0][:-1]}")],
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, md)
            assert "API key" in info.value.details()


def test_either_key_is_served_and_greedy_matches_the_reference(
    secure: Cluster, certs: devcerts.DevCerts, reference: list[int]
) -> None:
    """Through the mTLS hop to the executor, which therefore steps for this scheduler."""
    for key in KEYS:
        tokens = [
            t
            for r in generate(
                secure.address, greedy(PROMPT, MAX_TOKENS), timeout=120, api_key=key, tls_ca=certs.ca_cert
            )
            for t in r.token_ids
        ]
        assert tokens == reference
    # The scheme is case-insensitive, as HTTP's.
    with grpc.secure_channel(secure.address, secure.credentials) as ch:
        out = list(
            pb_grpc.GenerationStub(ch).Generate(
                greedy(PROMPT, 3), timeout=120, metadata=[("authorization", f"bearer {KEYS[1]}")]
            )
        )
    assert [t for r in out for t in r.token_ids] == reference[:3]


def test_cli_takes_the_key_from_the_environment(
    secure: Cluster, certs: devcerts.DevCerts, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--raw",
        "--json",
        "-n",
        "2",
        "--address",
        secure.address,
        "--tls-ca",
        str(certs.ca_cert),
        "Once upon a time",
    ]
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    assert client_main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("PAGEDSERVE_API_KEY", KEYS[1])
    assert client_main(argv) == 0
    assert '"finish_reason": "length"' in capsys.readouterr().out


def test_health_and_reflection_need_no_key(secure: Cluster) -> None:
    with grpc.secure_channel(secure.address, secure.credentials) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        answers = list(
            reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
    names = {s.name for s in answers[0].list_services_response.service}
    assert "pagedserve.v1.Generation" in names


def test_a_plaintext_client_cannot_talk_to_a_tls_port(secure: Cluster) -> None:
    for address in (secure.address, secure.executor.address):
        assert not grpc_healthy(address, LIVENESS)  # not even health
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                list(
                    pb_grpc.GenerationStub(ch).Generate(
                        greedy(PROMPT, 2), timeout=10, metadata=[("authorization", f"Bearer {KEYS[0]}")]
                    )
                )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_ca_is_refused(secure: Cluster, tmp_path: Path) -> None:
    other = devcerts.write(tmp_path / "other")
    with grpc.secure_channel(secure.address, channel_credentials(other.ca_cert)) as ch:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_public_port_caps_message_size_in_the_transport(stub: pb_grpc.GenerationStub) -> None:
    """Over PUBLIC_MAX_MESSAGE_BYTES the transport refuses; below it, over --max-request-bytes,
    the handler does, naming the limit."""
    md = [("authorization", f"Bearer {KEYS[0]}")]
    codes = {}
    for size in (PUBLIC_MAX_MESSAGE_BYTES + 1024, PUBLIC_MAX_MESSAGE_BYTES // 2):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="x" * size), timeout=30, metadata=md))
        codes[size] = info.value.code()
    assert list(codes.values()) == [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT]


# --- the executor's port ---------------------------------------------------------


def _executor_call(
    address: str, creds: grpc.ChannelCredentials, call: str, metadata: list[tuple[str, str]] | None = None
) -> object:
    with grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS) as ch:
        stub = epb_grpc.ExecutorStub(ch)
        if call == "Step":
            return stub.Step(epb.StepPlan(), timeout=10, metadata=metadata)
        if call == "Info":
            return stub.Info(epb.InfoRequest(omit_tokenizer_files=True), timeout=10, metadata=metadata)
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)


def test_the_executor_requires_a_client_certificate_from_its_ca(
    secure: Cluster, certs: devcerts.DevCerts, tmp_path: Path
) -> None:
    other = devcerts.write(tmp_path / "other")
    token = [(INTERNAL_TOKEN, certs.internal_token.read_text().strip())]
    refused = {
        "no client certificate": channel_credentials(certs.ca_cert),
        "a certificate from another CA": channel_credentials(certs.ca_cert, other.scheduler_cert, other.scheduler_key),
    }
    for what, creds in refused.items():
        for call in ("Step", "Info", "Health"):
            with pytest.raises(grpc.RpcError) as info:
                _executor_call(secure.executor.address, creds, call, token)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (what, call)  # the handshake fails
    good = secure.internal_credentials
    assert isinstance(_executor_call(secure.executor.address, good, "Info", token), epb.InfoResponse)
    # `pagedserve health`, the probe that speaks TLS, needs the client certificate too.
    probe = ["health", "--address", secure.executor.address, "--tls-ca", str(certs.ca_cert)]
    assert client_main(probe) == 1
    assert client_main([*probe, "--tls-cert", str(certs.scheduler_cert), "--tls-key", str(certs.scheduler_key)]) == 0


def test_the_executor_requires_the_internal_token_but_not_for_health(secure: Cluster, certs: devcerts.DevCerts) -> None:
    good = secure.internal_credentials
    for md in (None, [(INTERNAL_TOKEN, "wrong")], [("authorization", f"Bearer {KEYS[0]}")]):
        for call in ("Step", "Info"):
            with pytest.raises(grpc.RpcError) as info:
                _executor_call(secure.executor.address, good, call, md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (call, md)
            assert INTERNAL_TOKEN in info.value.details()
    health = _executor_call(secure.executor.address, good, "Health")
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # type: ignore[attr-defined]


def test_a_scheduler_with_a_foreign_client_certificate_never_reaches_the_executor(
    secure: Cluster, certs: devcerts.DevCerts, tmp_path: Path
) -> None:
    """It trusts the executor (the right CA) but shows a certificate from another CA: the
    executor's handshake refuses it, so it never gets the tokenizer (health stays
    NOT_SERVING) and cannot lead, let alone step, the executor."""
    other = devcerts.write(tmp_path / "other")
    log = secure.log_dir / f"scheduler-{len(secure.schedulers)}.log"
    bad = secure.start_scheduler(
        [
            "--tls-cert",
            str(other.scheduler_cert),
            "--tls-key",
            str(other.scheduler_key),
            "--tls-ca",
            str(certs.ca_cert),
            "--internal-token-file",
            str(certs.internal_token),
            "--api-key-file",
            str(certs.api_keys),
        ],
        ready=LIVENESS,
        secure=False,
        credentials=channel_credentials(other.ca_cert),
    )
    try:
        wait_until(
            lambda: "UNAVAILABLE; trying another" in log.read_text(errors="replace"),
            60,
            "the foreign scheduler's Info refused",
        )
        assert not grpc_healthy(bad.address, "", channel_credentials(other.ca_cert))
        assert "leads executor" not in log.read_text(errors="replace")
    finally:
        bad.stop()
        secure.schedulers.remove(bad)
    # The rightful scheduler still steps.
    out = list(generate(secure.address, greedy(PROMPT, 2), timeout=120, api_key=KEYS[0], tls_ca=certs.ca_cert))
    assert out[-1].finish_reason == "length"


def test_without_tls_the_internal_token_guards_the_executor(
    tiny_llama: Path, redis_url: str, certs: devcerts.DevCerts, tmp_path: Path, reference: list[int]
) -> None:
    """Plaintext everywhere, the token the only guard: the scheduler sends it and steps; a
    caller without it is UNAUTHENTICATED, health stays open."""
    with make_cluster(
        tiny_llama, redis_url, "token-only", tmp_path, internal_token_file=certs.internal_token
    ) as cluster:
        tokens = [t for r in generate(cluster.address, greedy(PROMPT, MAX_TOKENS), timeout=120) for t in r.token_ids]
        assert tokens == reference
        with grpc.insecure_channel(cluster.executor.address, options=CHANNEL_OPTIONS) as ch:
            stub = epb_grpc.ExecutorStub(ch)
            for md in (None, [(INTERNAL_TOKEN, "wrong")]):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Step(epb.StepPlan(), timeout=10, metadata=md)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            token = [(INTERNAL_TOKEN, certs.internal_token.read_text().strip())]
            assert stub.Info(epb.InfoRequest(omit_tokenizer_files=True), timeout=10, metadata=token).model
        assert grpc_healthy(cluster.executor.address)


# --- reload without restart ------------------------------------------------------


def test_certificates_reload_without_a_restart(secure: Cluster, certs: devcerts.DevCerts, reference: list[int]) -> None:
    """New leaves from the same CA written over the files: new connections are shown them;
    the processes are the same ones, and serve on."""
    pids = [s.proc.pid for s in (*secure.schedulers, *secure.executors)]
    ca, ca_key = devcerts.load_ca(certs)
    client = (certs.scheduler_cert, certs.scheduler_key)
    before = (
        _served_cert_serial(secure.address, certs.ca_cert),
        _served_cert_serial(secure.executor.address, certs.ca_cert, client),
    )
    assert before == (_serial(certs.scheduler_cert), _serial(certs.executor_cert))
    devcerts.write_leaf(certs.executor_cert, certs.executor_key, ca, ca_key, "executor", ["127.0.0.1"])
    devcerts.write_leaf(certs.scheduler_cert, certs.scheduler_key, ca, ca_key, "scheduler", ["127.0.0.1"])
    assert _served_cert_serial(secure.executor.address, certs.ca_cert, client) == _serial(certs.executor_cert)
    # The file check alone reloads; SIGHUP (as an operator would send) changes nothing more.
    os.kill(secure.scheduler.proc.pid, signal.SIGHUP)
    assert _served_cert_serial(secure.address, certs.ca_cert) == _serial(certs.scheduler_cert)
    assert _serial(certs.scheduler_cert) != before[0]
    tokens = [
        t
        for r in generate(
            secure.address, greedy(PROMPT, MAX_TOKENS), timeout=120, api_key=KEYS[0], tls_ca=certs.ca_cert
        )
        for t in r.token_ids
    ]
    assert tokens == reference
    assert [s.proc.pid for s in (*secure.schedulers, *secure.executors)] == pids
    assert all(s.proc.poll() is None for s in (*secure.schedulers, *secure.executors))


def test_api_keys_rotate_without_a_restart(secure: Cluster, certs: devcerts.DevCerts) -> None:
    original = certs.api_keys.read_text()
    try:
        certs.api_keys.write_text("brand-new-key-cccccccccccccccccccccc\n")
        with grpc.secure_channel(secure.address, secure.credentials) as ch:
            stub = pb_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.Abort(
                    pb.AbortRequest(request_id="nope"), timeout=10, metadata=[("authorization", f"Bearer {KEYS[0]}")]
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.Abort(
                pb.AbortRequest(request_id="nope"),
                timeout=10,
                metadata=[("authorization", "Bearer brand-new-key-cccccccccccccccccccccc")],
            )
    finally:
        certs.api_keys.write_text(original)


# --- the pure parts --------------------------------------------------------------


def test_secret_files_parse_reload_and_keep_the_last_good_secrets(tmp_path: Path) -> None:
    assert parse_secrets("# c\n\n a \r\nb\n  # also a comment\n") == (b"a", b"b")
    path = tmp_path / "keys"
    path.write_text("")
    with pytest.raises(ValueError, match="--api-key-file.*no secret"):
        SecretFile(path, "--api-key-file")
    with pytest.raises(ValueError, match="cannot read"):
        SecretFile(tmp_path / "missing", "--api-key-file")
    path.write_text("one\n")
    keys = SecretFile(path, "--api-key-file")
    assert keys.matches(b"one") and not keys.matches(b"on") and not keys.matches(b"one\n")
    path.write_text("one\ntwo\n")
    assert keys.matches(b"two")
    path.unlink()
    assert keys.matches(b"one")  # mid-replacement: the last good set stays
    path.write_text("three\n")
    assert keys.current() == (b"three",)
    # SIGHUP rereads even a file whose stat looks unchanged.
    st = path.stat()
    with open(path, "r+") as f:
        f.write("fouro")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert keys.current() == (b"three",)
    keys.request_reload()
    assert keys.current() == (b"fouro",)


def test_bearer_extraction() -> None:
    md = [
        ("authorization", "Bearer abc"),
        ("x-other", "Bearer no"),
        ("authorization", "BEARER  def "),
        ("authorization", "Basic ghi"),
        ("authorization", "Bearer"),
    ]
    assert bearer(md) == [b"abc", b"def"]
    assert bearer(None) == []


def test_the_certificate_fetcher_reloads_on_change_or_request_and_refuses_a_mismatched_pair(tmp_path: Path) -> None:
    out = devcerts.write(tmp_path / "c")
    fetcher = ReloadingCertificate(out.executor_cert, out.executor_key, out.ca_cert)
    assert fetcher.fetch() is None
    fetcher.request_reload()
    assert fetcher.fetch() is not None and fetcher.fetch() is None
    # A certificate whose key has not arrived yet: the current pair stays until it has.
    ca, ca_key = devcerts.load_ca(out)
    cert, _ = devcerts.make_leaf(ca, ca_key, "executor", ["127.0.0.1"])
    from cryptography.hazmat.primitives import serialization

    out.executor_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    assert fetcher.fetch() is None
    devcerts.write_leaf(out.executor_cert, out.executor_key, ca, ca_key, "executor", ["127.0.0.1"])
    assert fetcher.fetch() is not None


def test_tls_flag_problems_are_named() -> None:
    assert TLSFiles(cert=Path("/x")).problem() == "--tls-cert and --tls-key go together"
    assert "--tls-ca" in (TLSFiles(ca=Path("/nonexistent/ca.crt")).problem() or "")


def test_devcerts_writes_the_agreed_files(tmp_path: Path) -> None:
    out = devcerts.write(tmp_path / "d", hosts=["scheduler.example", "10.0.0.7"])
    assert sorted(p.name for p in out.dir.iterdir()) == sorted(
        [
            "ca.crt",
            "ca.key",
            "scheduler.crt",
            "scheduler.key",
            "executor.crt",
            "executor.key",
            "api-keys",
            "internal-token",
        ]
    )
    cert = x509.load_pem_x509_certificate(out.executor_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "executor", "scheduler.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.0.0.7"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in eku} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}
    assert len(SecretFile(out.api_keys, "k").current()) == 1
    assert out.executor_key.stat().st_mode & 0o077 == 0
    again = devcerts.write(out.dir, keep=True)
    assert _serial(again.ca_cert) == _serial(out.ca_cert)
