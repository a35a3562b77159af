"""Building and loading the CPU kernels' shared libraries (``cpu_attention.py``, ``cpu_linear.py``): the system's
``g++``, the library written atomically into the kernel cache, and one error that says why a kernel is unavailable."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here (the message says why)."""


def compile_library(target: Path, args: list[str]) -> None:
    """``g++ args -o target``, atomically: the library appears whole or not at all."""
    cxx = shutil.which("g++")
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *args, "-o", tmp], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise KernelUnavailable(f"g++ failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent build (another worker, another executor) loads either copy
    finally:
        Path(tmp).unlink(missing_ok=True)
