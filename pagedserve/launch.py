"""A whole local deployment: Redis, executors that register in it, one scheduler.

``python -m pagedserve.launch`` is what ``make run`` starts: it serves the
default model on localhost:50051, streams the answer to a sample chat prompt,
then keeps serving until Ctrl-C. ``Cluster`` is the same thing as a context
manager for tests and benchmarks.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.procs import RedisServer, Service, free_port
from pagedserve.rpc import LIVENESS


class Cluster:
    """``executors`` executor processes register in Redis (``--redis-url``,
    ``--advertise-address``) under ``namespace``; one scheduler (no
    ``--executor``) serves them all. More of either can be started later."""

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
    ) -> None:
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pagedserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self._redis: RedisServer | None = None
        self.executors: list[Service] = []
        self.schedulers: list[Service] = []
        self._executor_args = ["--block-size", str(block_size), *(executor_args or [])]
        if model:
            self._executor_args += ["--model", str(model)]
        if kv_cache_memory is not None:
            self._executor_args += ["--kv-cache-memory", str(kv_cache_memory)]
        try:
            if redis_url is None:
                self._redis = RedisServer()
                redis_url = self._redis.url
            self.redis_url = redis_url
            for i in range(executors):
                self.add_executor(port=executor_port if i == 0 else None)
            self.start_scheduler(scheduler_args or [], port, ready="" if executors else LIVENESS)
        except BaseException:
            self.close()
            raise

    def add_executor(self, args: list[str] | None = None, port: int | None = None) -> Service:
        """Start one more executor; it registers itself and schedulers pick it up."""
        port = port or free_port()
        svc = Service("executor_svc", [
            *self._executor_args, "--redis-url", self.redis_url, "--advertise-address", f"127.0.0.1:{port}",
            "--namespace", self.namespace, *(args or []),
        ], port, self.log_dir / f"executor-{len(self.executors)}.log")
        self.executors.append(svc)
        return svc

    def start_scheduler(self, args: list[str], port: int | None = None, ready: str = "") -> Service:
        """Start one more scheduler replica (API and loops) on the same namespace; ``ready``
        as for ``Service`` (a scheduler is SERVING only once an executor serves)."""
        svc = Service(
            "scheduler_svc",
            ["--redis-url", self.redis_url, "--namespace", self.namespace, *args],
            port or free_port(),
            self.log_dir / f"scheduler-{len(self.schedulers)}.log",
            ready=ready,
        )
        self.schedulers.append(svc)
        return svc

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
        for svc in [*self.schedulers, *self.executors]:
            svc.stop()
        if self._redis is not None:
            self._redis.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SAMPLE = "What is PagedAttention, in one sentence?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.launch", description=__doc__)
    p.add_argument("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--executor-port", type=int, default=50061, help="the first executor's port (others: free ports)")
    p.add_argument("--executors", type=int, default=1, help="executor processes, each with its own KV pool")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prompt", default=SAMPLE, help="sample chat prompt streamed once at start")
    args = p.parse_args(argv)
    redis_url = os.environ.get("REDIS_URL")
    print(f"starting pagedserve (redis: {redis_url or 'embedded redis-server'}) ...", flush=True)
    with Cluster(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        scheduler_args=["--max-num-batched-tokens", str(args.max_num_batched_tokens)],
        redis_url=redis_url,
        port=args.port,
        executor_port=args.executor_port,
        log_dir=Path(".cache/logs"),
        executors=args.executors,
    ) as cluster:
        from pagedserve.client import stream_chat

        print(f"serving pagedserve.v1.Generation on {cluster.address} with {len(cluster.executors)} executor(s); "
              f"logs in {cluster.log_dir}/")
        print(f"> {args.prompt}")
        stream_chat(cluster.address, args.prompt, out=sys.stdout)
        print(f"\nready: try `.venv/bin/pagedserve generate --address {cluster.address} \"Hello\"`. Ctrl-C stops.")
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
