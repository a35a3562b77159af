"""GPU readiness check: kernels, then a real bf16 deployment against transformers, in under five minutes.

``python -m benchmarks.gpu_check [--dry-run] [--out DIR] [--model DIR]``

Two phases, each in its own process group with a hard time limit (killed, with
its children, when it overruns) and each writing ``<phase>.json`` into DIR:

1. ``kernels``: ``benchmarks.kernels`` (bandwidth and time against SDPA) in bf16;
   every path's max abs error against SDPA must stay under ``KERNEL_TOLERANCE``.
2. ``e2e``: transformers ``generate(do_sample=False)`` on the same device and
   dtype gives the reference tokens (and its logits); then a ``Cluster``
   (redis-server, one executor with the Triton attention backend, one scheduler)
   serves the same prompts greedily. Tokens are compared one by one; a prompt
   passes when identical, or when its first divergence is at a near-tie of the
   reference (its logit for its own token exceeds its logit for ours by at most
   ``NEAR_TIE``): two bf16 implementations summing in different orders may pick
   either of two nearly tied tokens, and after that the texts legitimately
   differ; and at least half the prompts must be identical throughout. fp32 (the
   dry run) demands identity, as tests/test_e2e_oracle.py does.
   Then a batch of ``ignore_eos`` requests measures output tokens/s.

``gpu_check.json`` in DIR sums it up (the last line printed is its path); exit 0 only
if every phase passed, and, without ``--dry-run``, ran on a GPU.
``--dry-run`` (and, automatically, a machine without CUDA) runs the same code on
CPU: kernels under ``TRITON_INTERPRET=1`` at tiny sizes, a tiny random Llama in
fp32 instead of SmolLM2 in bf16. Without ``--dry-run`` such a run exits 2 even
when it passes, so that a CPU run is never mistaken for a GPU pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("kernels", "e2e")
TOTAL_BUDGET_S = 290.0  # the whole GPU check, phases included
# Max abs error of a kernel path against SDPA on the same unit-normal Q/K/V. Outputs reach ~5, where one
# bf16 ulp is 0.03: this catches wrong blocks, masks or scales (errors of order 1), not ulp-level drift,
# which tests/kernels checks tightly against the fp32 reference.
KERNEL_TOLERANCE = {"bf16": 1e-1, "fp16": 2e-2, "fp32": 1e-4}
# Largest reference logit gap (its token's logit minus ours) at which a divergence counts as a near-tie:
# SmolLM2's logits are ~10-30, where a bf16 ulp is 0.06-0.125, so 1.0 is a handful of ulps
# (a 2.7x probability ratio); a real bug diverges early by many logits. fp32 demands identity.
NEAR_TIE = {"bfloat16": 1.0, "float16": 0.25, "float32": 0.0}
# Beyond near-ties, at least this fraction of the prompts must be token-identical throughout.
MIN_IDENTICAL = {"bfloat16": 0.5, "float16": 0.5, "float32": 1.0}
TEXTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind that blows over it at night.",
    'def fibonacci(n):\n    """Return the nth Fibonacci number."""\n',
    "Explain why the sky is blue to a five year old child, using simple words and a friendly tone.",
    "List three benefits of regular exercise:",
    "Once upon a time, in a land far, far away, there lived a dragon who loved to read books. Every",
    "Translate into French: 'The cat sleeps on the warm windowsill while the rain falls outside.'",
    "Q: What is 12 times 12?\nA:",
]


@dataclass(frozen=True, slots=True)
class Config:
    """Everything that differs between the GPU run and the dry run."""

    dry_run: bool
    device: str  # torch device of both phases
    dtype: str  # executor --dtype and the reference's torch dtype
    kernel_dtype: str  # benchmarks.kernels --dtype
    budgets_s: dict[str, float]  # per phase, a hard limit
    identity_prompts: int  # of TEXTS
    identity_lengths: tuple[int, ...]  # prompt tokens, around the 16-token block
    identity_max_tokens: int
    tput_requests: int
    tput_prompt_tokens: int
    tput_max_tokens: int
    executor_args: tuple[str, ...]
    rpc_timeout_s: float  # gRPC deadline of one batch of requests


def make_config(dry_run: bool) -> Config:
    if dry_run:
        return Config(
            dry_run=True,
            device="cpu",
            dtype="float32",
            kernel_dtype="fp32",
            budgets_s={"kernels": 60.0, "e2e": 120.0},
            identity_prompts=4,
            identity_lengths=(3, 15, 17, 33),
            identity_max_tokens=6,
            tput_requests=4,
            tput_prompt_tokens=16,
            tput_max_tokens=4,
            executor_args=(
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--attention-backend",
                "triton",
                "--kv-cache-memory",
                str(4 << 20),
                "--swap-space",
                "0",
            ),
            rpc_timeout_s=60.0,
        )
    return Config(
        dry_run=False,
        device="cuda",
        dtype="bfloat16",
        kernel_dtype="bf16",
        budgets_s={"kernels": 100.0, "e2e": 180.0},
        identity_prompts=8,
        identity_lengths=(3, 15, 16, 17, 31, 33, 48, 70),
        identity_max_tokens=48,
        tput_requests=32,
        tput_prompt_tokens=64,
        tput_max_tokens=128,
        # Half the GPU: the pool is still profiled (the real path), and the check's own process keeps room.
        executor_args=(
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--attention-backend",
            "triton",
            "--gpu-memory-utilization",
            "0.5",
        ),
        rpc_timeout_s=60.0,
    )


@dataclass(slots=True)
class PhaseResult:
    name: str
    passed: bool
    wall_s: float
    budget_s: float
    error: str | None
    log: str
    details: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- phase: kernels


def _cpu_kernel_rows(cfg: Config) -> tuple[list[dict[str, Any]], float | None]:
    """The dry run's stand-in for ``benchmarks.kernels.main``: its builders on CPU at tiny
    sizes, the Triton paths interpreted, timed once with a wall clock (meaningless but present)."""
    from benchmarks import kernels as kb
    from paged_kernels import triton_ops

    heads, kv_heads, head_dim, block = 4, 2, 32, 16
    batches = [
        kb.Batch("decode 3 x ctx 40", 3, 40),
        kb.Batch("mixed: 1 chunk 16 on 8 + 2 decodes ctx 24", 2, 24, 1, 8, 16),
    ]
    rows = []
    for batch in batches:
        query, kc, vc, meta, groups, moved = kb._build(
            batch, heads, kv_heads, head_dim, block, kb.DTYPES[cfg.kernel_dtype], cfg.device
        )
        inputs = (query, kc, vc, meta, head_dim**-0.5)
        sdpa = kb._sdpa(groups, head_dim**-0.5)
        sdpa_ms, outs = _wall_ms(sdpa)
        expected = _cat_heads(outs, heads, head_dim)
        splits = triton_ops.num_kv_splits(query.shape[0], meta, kv_heads, query.device)
        auto = f"auto ({f'split-kv x{splits}' if splits > 1 else 'unified'})"  # named as benchmarks.kernels does
        paths: dict[str, Callable[[], Any]] = {auto: lambda inputs=inputs: triton_ops.paged_attention(*inputs)}
        if not batch.prefill_seqs:
            paths["unified"] = lambda inputs=inputs: triton_ops.unified_attention(*inputs)
            paths["split-kv x2"] = lambda inputs=inputs: triton_ops.split_kv_attention(*inputs, 2)
        for path, fn in paths.items():
            ms, out = _wall_ms(fn)
            err = (out.float() - expected.float()).abs().max().item()
            gbps = moved / (ms * 1e-3) / 1e9
            rows.append(asdict(kb.Row(batch.name, path, ms * 1e3, gbps, None, sdpa_ms * 1e3, ms / sdpa_ms, err)))
    return rows, None


def _cat_heads(outs: list[Any], heads: int, head_dim: int) -> Any:
    """SDPA group outputs ``[S, H, L, D]`` back into packed token order ``[T, H, D]``."""
    import torch

    return torch.cat([o.transpose(1, 2).reshape(-1, heads, head_dim) for o in outs])


def _wall_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def _gpu_kernel_rows(cfg: Config, out_dir: Path) -> tuple[list[dict[str, Any]], float | None]:
    """``python -m benchmarks.kernels --dtype bf16`` as is; its table goes to this phase's log."""
    from benchmarks import kernels as kb

    path = out_dir / "kernels_bench.json"
    rc = kb.main(["--dtype", cfg.kernel_dtype, "--out", str(path)])
    if rc != 0 or not path.exists():
        raise RuntimeError(f"benchmarks.kernels exited {rc} without writing {path}")
    report = json.loads(path.read_text())
    return report["rows"], report["peak_gbps"]


def phase_kernels(cfg: Config, out_dir: Path) -> dict[str, Any]:
    rows, peak = _cpu_kernel_rows(cfg) if cfg.dry_run else _gpu_kernel_rows(cfg, out_dir)
    tol = KERNEL_TOLERANCE[cfg.kernel_dtype]
    worst = max(r["max_abs_err"] for r in rows)
    fractions = [r["peak_fraction"] for r in rows if r["peak_fraction"] is not None]
    bad = [f"{r['batch']} / {r['path']}: {r['max_abs_err']:.2e}" for r in rows if not r["max_abs_err"] <= tol]
    return {
        "passed": bool(rows) and not bad,
        "error": f"kernel error above {tol:g} against SDPA: {'; '.join(bad)}" if bad else None,
        "dtype": cfg.kernel_dtype,
        "tolerance": tol,
        "peak_gbps": peak,
        "rows": rows,
        "worst_abs_err": worst,
        "best_peak_fraction": max(fractions) if fractions else None,
    }


# ---------------------------------------------------------------- phase: e2e


@dataclass(slots=True)
class Served:
    token_ids: list[int]
    finish_reason: str
    completion_tokens: int


def tiny_model(dst: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (as tests/conftest.py builds), for the dry run."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from executor_svc.model_store import resolve_model

    if (dst / "config.json").exists():
        return dst
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
    )
    model.save_pretrained(dst)
    src = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def identity_prompts(model_dir: Path, cfg: Config) -> list[list[int]]:
    """Real text, padded or cut with more text to lengths that straddle block edges."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    filler = tok(" and then the story went on and on, as stories do," * 8).input_ids
    prompts = [tok(t).input_ids for t in TEXTS[: cfg.identity_prompts]]
    return [(p + filler)[:n] for p, n in zip(prompts, cfg.identity_lengths)]


def reference(model_dir: Path, prompts: list[list[int]], cfg: Config) -> tuple[list[list[int]], list[Any]]:
    """transformers' greedy tokens per prompt (batch 1, no padding) and its raw logits per step."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.dtype)).to(cfg.device).eval()
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=cfg.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=cfg.device),
                max_new_tokens=cfg.identity_max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens.append(out.sequences[0, len(ids) :].tolist())
            logits.append(torch.stack([step[0].float().cpu() for step in out.logits]))
    del model
    gc.collect()
    if cfg.device == "cuda":
        torch.cuda.empty_cache()  # the executor profiles the memory left on the device
    return tokens, logits


def compare(expected: list[int], served: list[int], logits: Any, tolerance: float) -> dict[str, Any]:
    """First divergence of ``served`` from ``expected`` and the reference's logit gap there."""
    n = next((i for i, (a, b) in enumerate(zip(expected, served)) if a != b), min(len(expected), len(served)))
    if n == len(expected) == len(served):
        return {
            "identical": True,
            "first_divergence": None,
            "logit_gap": None,
            "near_tie": None,
            "passed": True,
            "expected_tokens": len(expected),
            "served_tokens": len(served),
        }
    gap = None
    if n < min(len(expected), len(served), len(logits)):
        gap = float(logits[n][expected[n]] - logits[n][served[n]])
    near_tie = gap is not None and gap <= tolerance
    return {
        "identical": False,
        "first_divergence": n,
        "logit_gap": gap,
        "near_tie": near_tie,
        "passed": near_tie,
        "expected_tokens": len(expected),
        "served_tokens": len(served),
    }


async def _serve(address: str, reqs: list[Any], timeout: float) -> list[Served]:
    import grpc

    from pagedserve.rpc import CHANNEL_OPTIONS
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc

    async def one(stub: Any, req: Any) -> Served:
        res = Served([], "", 0)
        async for resp in stub.Generate(req, timeout=timeout):
            res.token_ids += resp.token_ids
            if resp.finish_reason:
                res.finish_reason, res.completion_tokens = resp.finish_reason, resp.completion_tokens
        return res

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)
        return list(await asyncio.gather(*(one(stub, r) for r in reqs)))


def serve(address: str, prompts: list[list[int]], max_tokens: int, timeout: float, ignore_eos: bool) -> list[Served]:
    """Greedy requests, all at once, each bounded by the gRPC deadline ``timeout``."""
    from pagedserve.v1 import generation_pb2 as pb

    reqs = [
        pb.GenerateRequest(
            prompt_token_ids=p,
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
        )
        for p in prompts
    ]
    return asyncio.run(_serve(address, reqs, timeout))


def identity(address: str, prompts: list[list[int]], ref: tuple[list[list[int]], list[Any]], cfg: Config) -> dict:
    served = serve(address, prompts, cfg.identity_max_tokens, cfg.rpc_timeout_s, ignore_eos=False)
    tol = NEAR_TIE[cfg.dtype]
    expected, logits = ref
    per = [
        {"prompt_tokens": len(p), **compare(e, s.token_ids, lg, tol)}
        for p, e, lg, s in zip(prompts, expected, logits, served)
    ]
    identical = sum(p["identical"] for p in per)
    passed = all(p["passed"] for p in per) and identical >= MIN_IDENTICAL[cfg.dtype] * len(per)
    return {
        "passed": passed,
        "near_tie_tolerance": tol,
        "min_identical_fraction": MIN_IDENTICAL[cfg.dtype],
        "max_tokens": cfg.identity_max_tokens,
        "identical": identical,
        "total": len(per),
        "prompts": per,
    }


def throughput(address: str, cfg: Config) -> dict[str, Any]:
    """Output tokens/s of ``tput_requests`` sent at once, after a short warm-up of the same shapes
    (so that first-use Triton compilation stays out of the measured window)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(cfg.tput_prompt_tokens)] for _ in range(cfg.tput_requests)]
    serve(address, prompts, 4, cfg.rpc_timeout_s, ignore_eos=True)
    t0 = time.perf_counter()
    served = serve(address, prompts, cfg.tput_max_tokens, cfg.rpc_timeout_s, ignore_eos=True)
    wall = time.perf_counter() - t0
    out_tokens = sum(s.completion_tokens for s in served)
    complete = all(s.completion_tokens == cfg.tput_max_tokens == len(s.token_ids) for s in served)
    return {
        "passed": complete,
        "requests": cfg.tput_requests,
        "prompt_tokens": cfg.tput_prompt_tokens,
        "max_tokens": cfg.tput_max_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
    }


def phase_e2e(cfg: Config, out_dir: Path, model: str | None) -> dict[str, Any]:
    from executor_svc.model_store import resolve_model
    from pagedserve.dev.launch import Cluster

    model_dir = Path(model) if model else (tiny_model(out_dir / "tiny-model") if cfg.dry_run else resolve_model(None))
    prompts = identity_prompts(model_dir, cfg)
    t0 = time.perf_counter()
    ref = reference(model_dir, prompts, cfg)
    t1 = time.perf_counter()
    with Cluster(
        str(model_dir),
        executor_args=list(cfg.executor_args),
        log_dir=out_dir / "logs",
        scheduler_args=["--max-num-batched-tokens", "512"],
    ) as cluster:
        t2 = time.perf_counter()
        ident = identity(cluster.address, prompts, ref, cfg)
        tput = throughput(cluster.address, cfg)
    errors = [
        *(
            []
            if ident["passed"]
            else ["greedy tokens diverged from transformers beyond a near-tie, or too few prompts were identical"]
        ),
        *([] if tput["passed"] else ["a throughput request ended short of max_tokens"]),
    ]
    return {
        "passed": not errors,
        "error": "; ".join(errors) or None,
        "model": str(model_dir),
        "dtype": cfg.dtype,
        "device": cfg.device,
        "attention_backend": "triton",
        "reference_s": t1 - t0,
        "startup_s": t2 - t1,
        "identity": ident,
        "throughput": tput,
    }


# ---------------------------------------------------------------- orchestration


def run_phase_child(name: str, cfg: Config, out_dir: Path, model: str | None) -> int:
    """Inside the phase's process: run it, and always leave ``<name>.json`` behind."""
    try:
        result = phase_kernels(cfg, out_dir) if name == "kernels" else phase_e2e(cfg, out_dir, model)
    except Exception as exc:  # reported in the JSON and the summary, not swallowed
        traceback.print_exc()
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the phase's process group (its executor, scheduler and
    redis-server included): a graceful SIGTERM would let an executor drain for over a minute."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def spawn_phase(name: str, args: argparse.Namespace, out_dir: Path, budget: float) -> PhaseResult:
    log = out_dir / f"{name}.log"
    argv = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check",
        "--phase",
        name,
        "--out",
        str(out_dir),
        *(["--dry-run"] if args.dry_run else []),
        *(["--model", args.model] if args.model else []),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # read when paged_kernels.triton_ops is imported, executors included
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(budget)
            error = None
        except subprocess.TimeoutExpired:
            error = f"timed out after {budget:.0f} s (killed with its children)"
        _kill_group(proc)  # leftovers of a finished phase too
    return _phase_result(name, out_dir, log, time.perf_counter() - t0, budget, error, proc.returncode)


def _phase_result(
    name: str, out_dir: Path, log: Path, wall: float, budget: float, error: str | None, rc: int | None
) -> PhaseResult:
    path = out_dir / f"{name}.json"
    details = json.loads(path.read_text()) if path.exists() and error is None else {}
    if error is None and not details:
        error = f"exited with code {rc} without writing {path.name}"
    error = error or details.pop("error", None)
    details.pop("error", None)
    passed = bool(details.pop("passed", False)) and error is None
    return PhaseResult(name, passed, wall, budget, error, str(log), details)


def environment(cfg: Config) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    cuda = torch.cuda.is_available() and not cfg.dry_run
    return {
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
    }


def summarize(report: dict[str, Any]) -> str:
    lines = [
        f"gpu_check ({report['mode']}, {report['environment']['device_name']}, torch "
        f"{report['environment']['torch']}, triton {report['environment']['triton']}): "
        f"{'PASS' if report['passed'] else 'FAIL'} in {report['wall_s']:.0f} s"
    ]
    for name, ph in report["phases"].items():
        verdict = "PASS" if ph["passed"] else "FAIL"
        lines.append(f"  {name:<8}{verdict}  {_phase_line(name, ph)}  [{ph['wall_s']:.0f} s of {ph['budget_s']:.0f} s]")
        if ph["error"]:
            lines.append(f"          {ph['error']} (log: {ph['log']})")
    return "\n".join(lines)


def _phase_line(name: str, ph: dict[str, Any]) -> str:
    d = ph["details"]
    if name == "kernels" and "rows" in d:
        frac = f", best {d['best_peak_fraction']:.0%} of peak bandwidth" if d.get("best_peak_fraction") else ""
        return f"{len(d['rows'])} paths, worst abs err {d['worst_abs_err']:.1e} (tol {d['tolerance']:g}){frac}"
    if name == "e2e" and "identity" in d:
        i, t = d["identity"], d["throughput"]
        ties = sum(1 for p in i["prompts"] if p["near_tie"])
        return (
            f"{d['dtype']}: {i['identical']}/{i['total']} prompts token-identical ({ties} near-tie divergences); "
            f"{t['output_tokens']} tokens in {t['wall_s']:.1f} s = {t['output_tokens_per_s']:.0f} tok/s"
        )
    return ""


def orchestrate(args: argparse.Namespace, out_dir: Path, cfg: Config, asked_dry: bool) -> int:
    """Run the phases one after another within ``TOTAL_BUDGET_S``; write and print the summary."""
    t0 = time.perf_counter()
    phases = {}
    for name in PHASES:
        left = TOTAL_BUDGET_S - (time.perf_counter() - t0)
        phases[name] = spawn_phase(name, args, out_dir, max(1.0, min(cfg.budgets_s[name], left)))
    passed = all(p.passed for p in phases.values())
    report = {
        "mode": "dry-run" if cfg.dry_run else "gpu",
        "dry_run_requested": asked_dry,
        "passed": passed,
        "environment": environment(cfg),
        "wall_s": time.perf_counter() - t0,
        "phases": {n: asdict(p) for n, p in phases.items()},
    }
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(summarize(report))
    print(out_dir / "gpu_check.json")
    if cfg.dry_run and not asked_dry:
        print("no CUDA device: only the dry run ran, on CPU; this is not a GPU pass (exit 2)", file=sys.stderr)
        return 2
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreted kernels, a tiny model, fp32, tiny sizes")
    p.add_argument("--out", type=Path, default=None, help="results directory (default: results/gpu-check-<time>)")
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2; a tiny random Llama when dry)")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # internal: run one phase in this process
    args = p.parse_args(argv)
    out_dir = args.out or ROOT / "results" / time.strftime("gpu-check-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.phase:
        return run_phase_child(args.phase, make_config(args.dry_run), out_dir, args.model)
    import torch

    asked_dry = args.dry_run
    if not torch.cuda.is_available() and not asked_dry:
        print("no CUDA device: running the dry mode on CPU instead (it will exit 2)", file=sys.stderr)
        args.dry_run = True
    return orchestrate(args, out_dir, make_config(args.dry_run), asked_dry)


if __name__ == "__main__":
    sys.exit(main())
