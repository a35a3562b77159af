"""A whole local deployment: Redis, executors that register in it, one scheduler.

``python -m pagedserve.dev.launch`` is what ``make run`` starts: it serves the
default model on localhost:50051, streams the answer to a sample chat prompt,
then keeps serving until Ctrl-C. ``Cluster`` is the same thing as a context
manager for tests and benchmarks.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import ssl
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from pagedserve.auth import SecretFile
from pagedserve.dev.devcerts import DevCerts
from pagedserve.dev.devcerts import write as write_devcerts
from pagedserve.dev.procs import RedisServer, Service, free_port, start_all, stop_all
from pagedserve.redis_check import where
from pagedserve.rpc import LIVENESS
from pagedserve.security import channel_credentials


class Cluster:
    """``executors`` executor processes register in Redis (``--redis-url``,
    ``--advertise-address``) under ``namespace``; one scheduler (no
    ``--executor``) serves them all. All start at once (``procs.start_all``);
    more of either can be started later.

    ``tls`` (a ``pagedserve.dev.devcerts`` set): TLS on every port, mutual TLS between
    scheduler and executors. ``api_key_file``: the scheduler requires a key from it;
    ``internal_token_file``: executors require, and schedulers send, that token.
    ``credentials`` and ``api_key`` are then what a client of the cluster uses.
    ``http_port``: the first scheduler also serves the OpenAI-compatible HTTP API there
    (``http_url``; HTTPS with ``tls``)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        kv_cache_memory: int | None = None,
        block_size: int = 16,
        scheduler_args: list[str] | None = None,
        executor_args: list[str] | None = None,
        redis_url: str | None = None,
        port: int | None = None,
        executor_port: int | None = None,
        log_dir: Path | None = None,
        namespace: str = "pagedserve",
        executors: int = 1,
        tls: DevCerts | None = None,
        api_key_file: Path | None = None,
        internal_token_file: Path | None = None,
        http_port: int | None = None,
    ) -> None:
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pagedserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self._redis: RedisServer | None = None
        self.executors: list[Service] = []
        self.schedulers: list[Service] = []
        self.tls = tls
        self.api_key_file = api_key_file
        self.internal_token_file = internal_token_file
        self.http_port = http_port
        token = ["--internal-token-file", str(internal_token_file)] if internal_token_file else []
        self._executor_security = [*_tls_args(tls, "executor"), *token]
        self._scheduler_security = [
            *_tls_args(tls, "scheduler"),
            *token,
            *(["--api-key-file", str(api_key_file)] if api_key_file else []),
        ]
        self._executor_args = ["--block-size", str(block_size), *(executor_args or [])]
        if model:
            self._executor_args += ["--model", str(model)]
        if kv_cache_memory is not None:
            self._executor_args += ["--kv-cache-memory", str(kv_cache_memory)]
        try:
            self._start(redis_url, executors, executor_port, port, scheduler_args or [])
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        redis_url: str | None,
        executors: int,
        executor_port: int | None,
        port: int | None,
        scheduler_args: list[str],
    ) -> None:
        """Redis (an embedded ``redis-server`` unless ``redis_url``), then the executors and the first
        scheduler, all at once; ``__init__`` closes whatever started if one fails."""
        if redis_url is None:
            self._redis = RedisServer()
            redis_url = self._redis.url
        self.redis_url = redis_url
        http = ["--http-port", str(self.http_port)] if self.http_port else []
        *self.executors, first = start_all(
            [
                *(
                    functools.partial(self._executor, i, [], executor_port if i == 0 else None)
                    for i in range(executors)
                ),
                functools.partial(self._scheduler, 0, [*http, *scheduler_args], port, "" if executors else LIVENESS),
            ]
        )
        self.schedulers.append(first)

    @property
    def credentials(self) -> grpc.ChannelCredentials | None:
        """For a client of the public port: trust the cluster's CA (None without TLS)."""
        return channel_credentials(self.tls.ca_cert) if self.tls else None

    @property
    def internal_credentials(self) -> grpc.ChannelCredentials | None:
        """For a peer of the executors: the CA and the scheduler's client certificate."""
        return (
            channel_credentials(self.tls.ca_cert, self.tls.scheduler_cert, self.tls.scheduler_key) if self.tls else None
        )

    @property
    def http_url(self) -> str | None:
        """The first scheduler's HTTP API (``https://`` with TLS), without ``/v1``; None without ``http_port``."""
        if not self.http_port:
            return None
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}"

    @property
    def api_key(self) -> str | None:
        """The first key of ``api_key_file``."""
        return SecretFile(self.api_key_file, "--api-key-file").first() if self.api_key_file else None

    def add_executor(
        self,
        args: list[str] | None = None,
        port: int | None = None,
        *,
        secure: bool = True,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> Service:
        """Start one more executor; it registers itself and schedulers pick it up. ``secure``
        False: without the cluster's TLS and token flags (pass your own in ``args``, and
        ``credentials`` for its health check if its port speaks TLS)."""
        svc = self._executor(len(self.executors), args or [], port, secure, credentials)
        self.executors.append(svc)
        return svc

    def start_scheduler(
        self,
        args: list[str],
        port: int | None = None,
        ready: str = "",
        *,
        secure: bool = True,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> Service:
        """Start one more scheduler replica (API and loops) on the same namespace; ``ready``
        as for ``Service`` (a scheduler is SERVING only once an executor serves); ``secure``
        and ``credentials`` as for ``add_executor``."""
        svc = self._scheduler(len(self.schedulers), args, port, ready, secure, credentials)
        self.schedulers.append(svc)
        return svc

    def _executor(
        self,
        i: int,
        args: list[str],
        port: int | None,
        secure: bool = True,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> Service:
        port = port or free_port()
        return Service(
            "executor_svc",
            [
                *self._executor_args,
                "--redis-url",
                self.redis_url,
                "--advertise-address",
                f"127.0.0.1:{port}",
                "--namespace",
                self.namespace,
                *(self._executor_security if secure else []),
                *args,
            ],
            port,
            self.log_dir / f"executor-{i}.log",
            credentials=self.internal_credentials if secure else credentials,
        )

    def _scheduler(
        self,
        i: int,
        args: list[str],
        port: int | None,
        ready: str,
        secure: bool = True,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> Service:
        return Service(
            "scheduler_svc",
            [
                "--redis-url",
                self.redis_url,
                "--namespace",
                self.namespace,
                *(self._scheduler_security if secure else []),
                *args,
            ],
            port or free_port(),
            self.log_dir / f"scheduler-{i}.log",
            ready=ready,
            credentials=self.credentials if secure else credentials,
        )

    @property
    def executor(self) -> Service:
        return self.executors[0]

    @property
    def scheduler(self) -> Service:
        return self.schedulers[0]

    @property
    def address(self) -> str:
        return self.scheduler.address

    def close(self) -> None:
        stop_all(self.schedulers)  # first: a scheduler stopping may still talk to its executors
        stop_all(self.executors)
        if self._redis is not None:
            self._redis.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tls_args(tls: DevCerts | None, role: str) -> list[str]:
    if tls is None:
        return []
    return [
        "--tls-cert",
        str(getattr(tls, f"{role}_cert")),
        "--tls-key",
        str(getattr(tls, f"{role}_key")),
        "--tls-ca",
        str(tls.ca_cert),
    ]


SAMPLE = "What is PagedAttention, in one sentence?"
HTTP_PORT = 8000  # vLLM's


def _port_or_free(port: int) -> int:
    """``port`` if nothing listens there, else a free one."""
    try:
        with socket.create_server(("0.0.0.0", port)):
            return port
    except OSError:
        return free_port()


def _served_model(cluster: Cluster) -> str:
    """The model name the HTTP API answers to, from its ``/v1/models``."""
    assert cluster.http_url is not None
    ctx = ssl.create_default_context(cafile=str(cluster.tls.ca_cert)) if cluster.tls else None
    req = urllib.request.Request(
        f"{cluster.http_url}/v1/models",
        headers={"Authorization": f"Bearer {cluster.api_key}"} if cluster.api_key else {},
    )
    with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
        return json.load(resp)["data"][0]["id"]


def http_usage(base: str, model: str, tls: DevCerts | None) -> str:
    """How to call the HTTP API: curl, and the ``openai`` client."""
    key = f"$(tail -1 {tls.api_keys})" if tls else "EMPTY"
    curl_tls = f' --cacert {tls.ca_cert} -H "Authorization: Bearer {key}"' if tls else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64})
    client = (
        f'OpenAI(base_url="{base}/v1", api_key=open("{tls.api_keys}").read().split()[-1], '
        f'http_client=httpx.Client(verify=ssl.create_default_context(cafile="{tls.ca_cert}")))'
        if tls
        else f'OpenAI(base_url="{base}/v1", api_key="EMPTY")'
    )
    return (
        f"OpenAI-compatible HTTP on {base}/v1 (docs/http.md):\n"
        f"  curl {base}/v1/chat/completions{curl_tls} -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n"
        f"  .venv/bin/python -c '{'import httpx, ssl; ' if tls else ''}from openai import OpenAI; client = {client}; "
        f'print(client.chat.completions.create(model="{model}", max_tokens=64, '
        f'messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)\''
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedserve.dev.launch", description=__doc__)
    p.add_argument("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--executor-port", type=int, default=50061, help="the first executor's port (others: free ports)")
    p.add_argument("--executors", type=int, default=1, help="executor processes, each with its own KV pool")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prompt", default=SAMPLE, help="sample chat prompt streamed once at start")
    p.add_argument(
        "--http-port",
        type=int,
        default=HTTP_PORT,
        help="the OpenAI-compatible HTTP API's port (a free one if it is taken; 0: off)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="serve tool_choice auto, reading calls with this parser (hermes): the scheduler's "
        "--enable-auto-tool-choice --tool-call-parser NAME (docs/http.md, Tools)",
    )
    p.add_argument(
        "--secure",
        type=Path,
        default=None,
        metavar="DIR",
        help="TLS on every port, mutual TLS to executors, an API key and the internal token, from the "
        "development certificates in DIR (written by pagedserve.dev.devcerts if missing)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tls = write_devcerts(args.secure, keep=True) if args.secure else None
    redis_url = os.environ.get("REDIS_URL")
    http_port = _port_or_free(args.http_port) if args.http_port else None
    print(f"starting pagedserve (redis: {where(redis_url) if redis_url else 'embedded redis-server'}) ...", flush=True)
    with Cluster(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        scheduler_args=["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        + (["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []),
        redis_url=redis_url,
        port=args.port,
        executor_port=args.executor_port,
        log_dir=Path(".cache/logs"),
        executors=args.executors,
        tls=tls,
        api_key_file=tls.api_keys if tls else None,
        internal_token_file=tls.internal_token if tls else None,
        http_port=http_port,
    ) as cluster:
        from pagedserve.client import stream_chat

        print(
            f"serving pagedserve.v1.Generation on {cluster.address} with {len(cluster.executors)} executor(s); "
            f"logs in {cluster.log_dir}/"
        )
        print(f"> {args.prompt}")
        stream_chat(
            cluster.address, args.prompt, out=sys.stdout, api_key=cluster.api_key, tls_ca=tls.ca_cert if tls else None
        )
        flags = f' --tls-ca {tls.ca_cert} --api-key "$(tail -1 {tls.api_keys})"' if tls else ""
        print(f'\nready: try `.venv/bin/pagedserve generate --address {cluster.address}{flags} "Hello"`.')
        if cluster.http_url:
            print(http_usage(cluster.http_url.replace("127.0.0.1", "localhost"), _served_model(cluster), tls))
        print("Ctrl-C stops.")
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        print("stopping ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
