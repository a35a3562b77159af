"""Real deployments for the benchmark arms, every process started at once, and reused by arms that agree on one.

``start`` deploys what ``pagedserve.dev.launch.Cluster`` deploys (redis-server, executors that register themselves in
one namespace with the same flags, one scheduler without ``--executor``, all started at once: ``procs.start_all``)
from a ``StackConfig``. ``Stacks`` keeps the last stack it started and hands it to the next arm that asks for an
identical ``StackConfig``, so arms grouped one after the other share a deployment instead of starting their own.
A stack that is not running a request is idle (its loop blocks on the doorbell), so an arm measures its own work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.dev.procs import RedisServer, Service, free_port, start_all, stop_all


@dataclass(frozen=True, slots=True)
class StackConfig:
    """A deployment's flags; two arms with equal configs can share one deployment (whose step log is the first's)."""

    kv_cache_bytes: int  # per executor
    block_size: int = 16
    executor_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    executors: int = 1
    namespace: str = "pagedserve"
    roles: tuple[str, ...] = ()  # executor i's --role (default: every one mixed)
    step_log: Path | None = field(default=None, compare=False)  # the scheduler's --step-log, emptied at start

    def scheduler_argv(self) -> list[str]:
        return [*self.scheduler_args, *(["--step-log", str(self.step_log)] if self.step_log else [])]


@dataclass(slots=True)
class Stack:
    config: StackConfig
    redis: RedisServer
    executors: list[Service]
    scheduler: Service
    log_dir: Path

    @property
    def address(self) -> str:
        return self.scheduler.address

    @property
    def services(self) -> list[Service]:
        return [self.scheduler, *self.executors]

    def stop(self) -> None:
        stop_all(self.services)
        self.redis.stop()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_log(path: Path) -> list[dict]:
    """A JSON-lines log's rows, read while its writer may still be appending (a live deployment's step log): a last
    line without its newline is one being written, and is left out."""
    if not path.exists():
        return []
    *lines, _partial = path.read_text().split("\n")
    return [json.loads(line) for line in lines if line.strip()]


def start(model_dir: Path, cfg: StackConfig, log_dir: Path) -> Stack:
    """Redis, then ``cfg.executors`` executors and the scheduler at once; log files named as Cluster names them."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if cfg.step_log is not None:
        cfg.step_log.parent.mkdir(parents=True, exist_ok=True)
        cfg.step_log.unlink(missing_ok=True)
    redis = RedisServer()

    def executor(i: int) -> Service:
        port = free_port()
        return Service(
            "executor_svc",
            [
                "--block-size",
                str(cfg.block_size),
                *cfg.executor_args,
                "--model",
                str(model_dir),
                "--kv-cache-memory",
                str(cfg.kv_cache_bytes),
                "--redis-url",
                redis.url,
                "--advertise-address",
                f"127.0.0.1:{port}",
                "--namespace",
                cfg.namespace,
                *(["--role", cfg.roles[i]] if i < len(cfg.roles) else []),
            ],
            port,
            log_dir / f"executor-{i}.log",
        )

    def scheduler() -> Service:
        return Service(
            "scheduler_svc",
            ["--redis-url", redis.url, "--namespace", cfg.namespace, *cfg.scheduler_argv()],
            free_port(),
            log_dir / "scheduler-0.log",
        )

    try:
        started = start_all([*(lambda i=i: executor(i) for i in range(cfg.executors)), scheduler])
    except BaseException:
        redis.stop()
        raise
    return Stack(cfg, redis, started[:-1], started[-1], log_dir)


class Stacks:
    """At most one live stack: ``get`` returns the live one when its config is equal, else stops it and starts anew.

    Arms that agree on a config run one after the other and share it; ``close`` stops whatever is left.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.live: Stack | None = None
        self.started = 0  # how many stacks this run started (reported with the arms' wall times)

    def get(self, cfg: StackConfig, log_dir: Path) -> Stack:
        if self.live is not None and self.live.config == cfg:
            return self.live
        self.close()
        self.live = start(self.model_dir, cfg, log_dir)
        self.started += 1
        return self.live

    def close(self) -> None:
        if self.live is not None:
            live, self.live = self.live, None
            live.stop()
