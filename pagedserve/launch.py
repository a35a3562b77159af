"""A whole local deployment: Redis, one executor, one scheduler.

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


class Cluster:
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
    ) -> None:
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pagedserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._redis: RedisServer | None = None
        self.executor: Service | None = None
        self.scheduler: Service | None = None
        try:
            if redis_url is None:
                self._redis = RedisServer()
                redis_url = self._redis.url
            self.redis_url = redis_url
            eargs = ["--block-size", str(block_size), *(executor_args or [])]
            if model:
                eargs += ["--model", str(model)]
            if kv_cache_memory is not None:
                eargs += ["--kv-cache-memory", str(kv_cache_memory)]
            self.executor = Service("executor_svc", eargs, executor_port or free_port(), self.log_dir / "executor.log")
            self.scheduler = self.start_scheduler(scheduler_args or [], port)
        except BaseException:
            self.close()
            raise

    def start_scheduler(self, args: list[str], port: int | None = None, name: str = "scheduler") -> Service:
        assert self.executor is not None
        return Service(
            "scheduler_svc",
            ["--redis-url", self.redis_url, "--executor", self.executor.address, *args],
            port or free_port(),
            self.log_dir / f"{name}.log",
        )

    @property
    def address(self) -> str:
        assert self.scheduler is not None
        return self.scheduler.address

    def close(self) -> None:
        for svc in (self.scheduler, self.executor):
            if svc is not None:
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
    p.add_argument("--executor-port", type=int, default=50061)
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
    ) as cluster:
        from pagedserve.client import stream_chat

        print(f"serving pagedserve.v1.Generation on {cluster.address}; logs in {cluster.log_dir}/")
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
