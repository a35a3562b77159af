"""Warm starts: a service process forked from a server that has already imported the services' code.

A ``python -m executor_svc`` spends ~7 s of CPU importing torch and transformers before it reads its first flag,
and the test suite starts about seventy executors and as many scheduler replicas: on 2 cores that was a third of
``make test``. With ``PAGEDSERVE_WARM_STARTS=1`` (``tests/conftest.py`` sets it), ``procs.Service`` starts its
process through ``multiprocessing``'s forkserver instead, which imports ``PRELOAD`` once (per test worker) and
forks each service from that image: the child is still its own process with its own pid, sockets, signals, log
file and exit status, running the same ``__main__`` with the same argv; only the imports are inherited.
``make run`` and the benchmarks start services as before (``python -m``), as a deployment does.

What a fork inherits and an exec would not: modules imported with the forkserver's environment (the pytest
worker's at its first warm start; nothing of ours reads configuration at import time, and the child gets the
caller's environment before ``__main__`` runs), and the ``random`` module's state (reseeded in the child).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import runpy
import signal
import subprocess
import sys
from multiprocessing.context import ForkServerContext
from pathlib import Path

ENV = "PAGEDSERVE_WARM_STARTS"
# What a service imports before serving: the executor's model code, the scheduler's frontend and loops.
PRELOAD = ["executor_svc.__main__", "executor_svc.server", "scheduler_svc.__main__", "scheduler_svc.frontend.replica"]

_context: ForkServerContext | None = None


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def _forkserver() -> ForkServerContext:
    global _context  # one forkserver per process that starts services (a test worker), made on first use
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    assert _context is not None
    return _context


def _main(module: str, args: list[str], env: dict[str, str], log: str | None) -> None:
    """The child: the caller's environment, output and argv, then the module's ``__main__``."""
    os.environ.clear()
    os.environ.update(env)
    random.seed()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    fd = os.open(log or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class Forked:
    """The part of ``subprocess.Popen``'s interface the launcher and the tests use, on a forked service."""

    def __init__(self, module: str, args: list[str], env: dict[str, str], log: Path | None) -> None:
        self.args = [sys.executable, "-m", module, *args]
        self._proc = _forkserver().Process(target=_main, args=(module, args, env, str(log) if log else None))
        self._proc.daemon = True  # never outlives the test worker, like the children of a killed pytest
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
