"""Runs the configured arms in order and hands their results to the report writer.

Each arm runs alone on the machine (arms are sequential) with the same torch
thread count; an arm that fails is recorded in the report instead of aborting
the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import analysis, report, vllm_peer
from benchmarks.config import PREVIOUS_QUICK, Config, kv_bytes_per_token
from benchmarks.kv_spread import SpreadResult
from benchmarks.lora_cost import LoraCostResult
from benchmarks.metrics import summarize
from benchmarks.overhead import OverheadPoint
from benchmarks.parallel import ParallelConfig, ParallelResult
from benchmarks.preemption import PreemptionPoint
from benchmarks.reattach import ReattachResult
from benchmarks.sampling_cost import SamplingPoint, ratio_at, share_at
from benchmarks.scale_out import ScaleOutConfig, ScaleOutPoint, efficiency
from benchmarks.shared_prefix import SharedPrefixConfig, SharedPrefixResult
from benchmarks.spec_decode import SpecBenchResult
from benchmarks.spec_decode import section as spec_section
from benchmarks.stack import StackConfig, Stacks
from benchmarks.structured import StructuredResult
from benchmarks.vllm_peer import PeerResult
from benchmarks.workload import Vocab, Workload, WorkloadSpec, make_workload

if TYPE_CHECKING:
    import torch

    from benchmarks.arm_pagedserve import ServeConfig


MIGRATION_KEYS = (
    "drain_recomputed_tokens",
    "drain_recomputed_tokens_recompute_arm",
    "migration_stall_ms_p50",
    "recompute_stall_ms_p50",
    "migration_stall_ratio",
    "migration_drain_s",
    "recompute_drain_s",
    "migration_resumed_s",
    "recompute_resumed_s",
    "migration_tokens_identical",
)
PD_KEYS = tuple(
    f"pd_{k}_ratio{suffix}" for suffix in ("", "_light", "_real") for k in ("itl_p99", "throughput", "ttft_p50")
)
PEER_PREFIX_KEYS = (
    "peer_prefix_ttft_ratio",
    "peer_prefix_ttft_ms_p50",
    "recompute_prefix_ttft_ms_p50",
    "peer_prefix_tokens_identical",
)


def short_spec(args: argparse.Namespace, cfg: Config) -> WorkloadSpec:
    return WorkloadSpec(
        args.distribution,
        cfg.num_requests,
        cfg.scale,
        tuple(args.input_range),
        tuple(args.output_range),
        cfg.max_total_len,
        args.rate,
        args.seed,
    )


def long_spec(args: argparse.Namespace, cfg: Config) -> WorkloadSpec:
    """Always ShareGPT-like: the point is long, long-tailed sequences, whatever the short workload draws from."""
    return WorkloadSpec(
        "sharegpt",
        cfg.long_num_requests,
        cfg.long_scale,
        tuple(args.input_range),
        tuple(args.output_range),
        cfg.long_max_total_len,
        args.rate,
        args.seed,
    )


@dataclass(slots=True)
class CoreRun:
    """What the pagedserve and transformers arms measured on one workload and KV budget (the short or long run)."""

    workload: Workload
    budget_tokens: int
    per_token: int  # KV bytes per token
    arms: dict[str, dict] = field(default_factory=dict)
    steps: list[dict[str, float]] = field(default_factory=list)  # pagedserve's step log
    static_util: float | None = None
    static_series: analysis.Series = field(default_factory=lambda: analysis.Series([], []))
    static_requests: int | None = None  # how many requests HF static served (a prefix of the workload)

    @property
    def budget_bytes(self) -> int:
        return self.budget_tokens * self.per_token

    def tokens_per_s(self) -> dict[str, float]:
        return {a: v["output_tokens_per_s"] for a, v in self.arms.items()}

    def ratio(self, other: str) -> float | None:
        tps = self.tokens_per_s()
        return tps["pagedserve"] / tps[other] if "pagedserve" in tps and tps.get(other) else None


def serve_config(args: argparse.Namespace, run: CoreRun, max_model_len: int) -> ServeConfig:
    from benchmarks.arm_pagedserve import ServeConfig

    return ServeConfig(
        run.budget_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode,
        max_model_len=max_model_len,
    )


def serve(run: CoreRun, stacks: Stacks, scfg: ServeConfig, log_dir: Path, errors: list[str], label: str) -> None:
    from benchmarks import arm_pagedserve

    deployment = stacks.get(arm_pagedserve.stack_config(scfg, log_dir / "steps.jsonl"), log_dir)
    res = arm_pagedserve.serve(deployment, run.workload)
    if res.failures:
        errors.append(f"{label}: {len(res.failures)} requests failed, e.g. {res.failures[0]}")
    run.arms["pagedserve"] = summarize(res.records, res.duration)
    run.steps = res.steps


def hf_static(run: CoreRun, model: torch.nn.Module, limit: int | None) -> None:
    """HF static batching on the workload's first ``limit`` requests (all when None): it is the slowest arm."""
    from benchmarks import arm_hf

    workload = run.workload if limit is None else Workload(run.workload.spec, run.workload.requests[:limit])
    res = arm_hf.run_static(model, workload, run.budget_tokens)
    run.arms["hf_static"] = summarize(res.records, res.duration)
    run.static_util, run.static_series = analysis.static_utilization(res.batches, res.batch_times)
    run.static_requests = len(workload.requests)


def hf_continuous(run: CoreRun, model: torch.nn.Module, args: argparse.Namespace) -> None:
    from benchmarks import arm_hf

    res = arm_hf.run_continuous(
        model,
        run.workload,
        arm_hf.CBConfig(
            run.budget_tokens, max_batch_tokens=args.max_num_batched_tokens, max_requests_per_batch=args.max_num_seqs
        ),
    )
    run.arms["hf_continuous"] = summarize(res.records, res.duration)


def overhead_grid(cfg: Config) -> list[tuple[list[int], list[int], tuple[str, ...]]]:
    """(running levels, waiting levels, loops) sweeps: the full grid, or queued requests at the largest running
    level only (and, with ``overhead_serial_top_only``, the serial loop there only).

    On 2 cores a level that never reaches its waiting target costs the sweep's 90 s timeout, and filling a
    queue behind few running requests says little the target point does not.
    """
    both = ("serial", "pipelined")
    if not cfg.overhead_waiting_top_only or not cfg.overhead_running:
        return [(cfg.overhead_running, cfg.overhead_waiting, both)]
    *lower, top = sorted(cfg.overhead_running)
    lower_loops = ("pipelined",) if cfg.overhead_serial_top_only else both
    return [g for g in ((lower, [0], lower_loops), ([top], cfg.overhead_waiting, both)) if g[0]]


def overhead_keys(points: list[OverheadPoint]) -> dict[str, object]:
    """``summary.json``'s scheduler-overhead keys: the pipelined loop's at the target point (the most running,
    then the most waiting), the serial loop's beside them, and pipelined / serial ratios."""

    def top(loop: str) -> OverheadPoint | None:
        return max((p for p in points if p.loop == loop), key=lambda p: (p.running, p.waiting), default=None)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    pipe, serial = top("pipelined"), top("serial")
    duty = {
        loop: next(
            (
                p.duty_cycle
                for p in points
                if p.loop == loop
                and p.running == 256
                and p.waiting == max(q.waiting for q in points if q.running == 256)
            ),
            None,
        )
        for loop in ("pipelined", "serial")
    }
    get = lambda p, k: getattr(p, k) if p else None  # noqa: E731
    return {
        "scheduler_overhead_ms_p50": get(pipe, "p50_ms"),
        "scheduler_overhead_ms_p99": get(pipe, "p99_ms"),
        "scheduler_overhead_at": {"running": pipe.running, "waiting": pipe.waiting} if pipe else None,
        "scheduler_overhead_ms_p50_serial": get(serial, "p50_ms"),
        "scheduler_overhead_ms_p99_serial": get(serial, "p99_ms"),
        "executor_duty_cycle_256": duty["pipelined"],
        "executor_duty_cycle_256_serial": duty["serial"],
        "step_gap_ms": {p.loop: {"p50": p.p50_ms, "p99": p.p99_ms} for p in (pipe, serial) if p},
        "overhead_step_ms": get(pipe or serial, "step_ms"),
        "scheduler_overhead_ratio_pipelined_vs_serial": ratio(get(pipe, "p50_ms"), get(serial, "p50_ms")),
        "executor_duty_cycle_ratio_pipelined_vs_serial": ratio(duty["pipelined"], duty["serial"]),
    }


# The logprobs, structured and parallel arms' deployment: room for either batch with no preemption, and for the
# parallel arm's 8 independent requests whole (8 x 34 blocks of SmolLM2's 46 KB/token: 200 MiB).
AUX_KV_BYTES = 256 << 20


def aux_stack(logs: Path) -> StackConfig:
    """The deployment the logprobs, structured and parallel arms share: default flags, 256 MiB of KV, a step log."""
    return StackConfig(AUX_KV_BYTES, step_log=logs / "aux" / "steps.jsonl")


def shared_prefix_config(args: argparse.Namespace, cfg: Config) -> SharedPrefixConfig:
    return SharedPrefixConfig(
        cfg.shared_prefix_requests,
        cfg.shared_prefix_system_len,
        budget_tokens=cfg.shared_prefix_budget_tokens,
        seed=args.seed,
        measure_off=cfg.shared_prefix_measure_off,
    )


def model_lens(cfg: Config, spc: SharedPrefixConfig | None) -> dict[int, int]:
    """``--max-model-len`` per KV budget (tokens): the longest sequence + 16 of every run on that budget (the short
    run's or the preemption probe's, the long run's, the shared-prefix arm's), so that runs on one budget have equal
    flags and share a deployment. The flag only caps admission: no sequence of any of them comes near it."""
    needs = [(cfg.kv_budget_tokens, max(cfg.max_total_len, max(cfg.preemption_lengths, default=0)) + 16)]
    if cfg.long_num_requests > 0:
        needs.append((cfg.long_kv_budget_tokens, cfg.long_max_total_len + 16))
    if spc is not None:
        needs.append((spc.budget_tokens, spc.model_len()))
    lens: dict[int, int] = {}
    for budget, need in needs:
        lens[budget] = max(lens.get(budget, 0), need)
    return lens


def long_summary(run: CoreRun | None, util: float | None) -> dict[str, object]:
    """The long run's ``summary.json`` keys (null when it did not run); ``util``: its steady-state KV utilization."""
    return {
        "throughput_ratio_vs_hf_continuous_long": run.ratio("hf_continuous") if run else None,
        "throughput_ratio_vs_hf_static_long": run.ratio("hf_static") if run else None,
        "kv_utilization_steady_state_long": util,
        "long": None
        if run is None
        else {
            "output_tokens_per_s": run.tokens_per_s(),
            "static_allocation_utilization": run.static_util,
            "hf_static_requests": run.static_requests,
            "workload": run.workload.describe(),
            "kv_budget_tokens": run.budget_tokens,
            "kv_budget_bytes": run.budget_bytes,
            "arms": run.arms,
        },
    }


def run_all(args: argparse.Namespace, cfg: Config, out: Path, started: float) -> dict:
    from executor_svc.model_store import resolve_model

    model_dir = resolve_model(args.model)
    per_token = kv_bytes_per_token(model_dir)
    vocab = Vocab.from_model_dir(model_dir)
    short = CoreRun(make_workload(short_spec(args, cfg), vocab), cfg.kv_budget_tokens, per_token)
    long = (
        CoreRun(make_workload(long_spec(args, cfg), vocab), cfg.long_kv_budget_tokens, per_token)
        if cfg.long_num_requests > 0
        else None
    )

    @functools.cache
    def hf_model() -> torch.nn.Module:  # loaded once for the short and the long run
        from benchmarks import arm_hf

        return arm_hf.load_model(model_dir, args.threads)

    errors: list[str] = []
    walls: dict[str, float] = {}  # each arm's wall time, a shared deployment's start-up in its first arm's
    overhead: list[OverheadPoint] = []
    preemption: list[PreemptionPoint] = []
    scale: list[ScaleOutPoint] = []
    spread: SpreadResult | None = None
    reattached: ReattachResult | None = None
    sampling: list[SamplingPoint] = []
    logprobs: dict | None = None
    structured: StructuredResult | None = None
    lora: LoraCostResult | None = None
    shared: SharedPrefixResult | None = None
    par: ParallelResult | None = None
    peer: PeerResult | None = None
    moved: dict[str, object] | None = None  # the migration arm (benchmarks/migration.py)
    spec: SpecBenchResult | None = None  # the spec_decode arm (benchmarks/spec_decode.py)
    pulled: dict[str, object] | None = None  # the peer_prefix arm (benchmarks/peer_prefix.py)
    split: dict[str, object] | None = None  # the disagg arm (benchmarks/disagg.py)
    scale_cfg = ScaleOutConfig(
        executors=cfg.scale_out_executors,
        running=cfg.scale_out_running,
        window_s=cfg.scale_out_window_s,
        step_ms=cfg.scale_out_step_ms,
    )
    logs = out / "logs"
    stacks = Stacks(model_dir)
    spc = shared_prefix_config(args, cfg)
    lens = model_lens(cfg, spc if "shared_prefix" in cfg.arms else None)
    spc = dataclasses.replace(spc, max_model_len=lens.get(spc.budget_tokens, 0))

    def attempt(name: str, fn, share: bool = False) -> None:  # type: ignore[no-untyped-def]
        """Run one arm; a failure is recorded, not raised. ``share``: leave its deployment up for the next arm."""
        t = time.monotonic()
        print(f"[bench] {name} ...", flush=True)
        try:
            fn()
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc} (logs in {logs})")
            traceback.print_exc()
        if not share:
            stacks.close()
        walls[name] = round(time.monotonic() - t, 1)
        print(f"[bench] {name} done in {walls[name]:.0f} s", flush=True)

    def paged() -> None:
        from benchmarks import arm_pagedserve
        from benchmarks import preemption as pre

        nonlocal preemption
        scfg = serve_config(args, short, lens[short.budget_tokens])
        log_dir = logs / "pagedserve"
        probe = None
        try:
            # The probe's executor (one of its own: the deployment's is fenced by its loop's epoch) starts beside the
            # deployment; both are up and idle before the timed run starts.
            with ThreadPoolExecutor(1) as pool:
                started = (
                    pool.submit(
                        pre.start_executor,
                        arm_pagedserve.standalone_executor_args(model_dir, scfg),
                        log_dir / "preemption-executor.log",
                    )
                    if cfg.preemption_lengths
                    else None
                )
                try:
                    stacks.get(arm_pagedserve.stack_config(scfg, log_dir / "steps.jsonl"), log_dir)
                finally:
                    probe = started.result() if started else None
            serve(short, stacks, scfg, log_dir, errors, "pagedserve")
            write_steps(short.steps, out / "pagedserve_steps.jsonl")
            if probe is not None:
                preemption = pre.measure(probe.address, cfg.preemption_lengths, vocab)
        finally:
            if probe is not None:
                probe.stop()

    def long_paged(run: CoreRun) -> None:
        serve(
            run,
            stacks,
            serve_config(args, run, lens[run.budget_tokens]),
            logs / "pagedserve_long",
            errors,
            "pagedserve (long)",
        )
        write_steps(run.steps, out / "pagedserve_long_steps.jsonl")

    def sweep() -> None:
        from benchmarks import overhead as ovh

        nonlocal overhead
        overhead = ovh.sweep(
            model_dir,
            overhead_grid(cfg),
            cfg.overhead_window_s,
            logs / "overhead",
            reach_s=cfg.overhead_reach_s,
            step_ms=cfg.overhead_step_ms,
        )

    def scale_out() -> None:
        from benchmarks import scale_out as so

        nonlocal scale
        scale = so.sweep(model_dir, scale_cfg, logs / "scale_out")
        missing = sorted(set(scale_cfg.executors) - {p.executors for p in scale})
        if missing:
            errors.append(
                f"scale_out: no measurement at {missing} executors (never reached the target; the "
                f"harness output says which executor was unled or idle; logs in {logs / 'scale_out'})"
            )

    def kv_spread() -> None:
        from benchmarks import kv_spread as ks

        nonlocal spread
        spread = ks.run(
            model_dir,
            ks.SpreadConfig(
                cfg.kv_spread_budget_tokens,
                cfg.kv_spread_requests,
                sample_s=cfg.kv_spread_sample_ms / 1000,
                seed=args.seed,
            ),
            per_token,
            logs / "kv_spread",
        )
        (out / "kv_spread_series.json").write_text(json.dumps(spread.series))

    def migration() -> None:
        from benchmarks import migration as mg

        nonlocal moved
        mcfg = mg.MigrationConfig(
            cfg.migration_requests, cfg.migration_prompt_len, cfg.migration_output_len, seed=args.seed
        )
        r = mg.run(model_dir, mcfg, logs / "migration")
        moved = {**r.keys(), "modes": {m: x.as_dict() for m, x in r.modes.items()}}

    def spec_decode() -> None:
        from benchmarks import spec_decode as sd

        nonlocal spec
        scfg = sd.SpecBenchConfig(
            cfg.spec_requests, cfg.spec_batch, cfg.spec_rounds, cfg.spec_max_tokens, seed=args.seed
        )
        spec = sd.run(model_dir, scfg, logs / "spec_decode")

    def peer_prefix() -> None:
        from benchmarks import peer_prefix as pp

        nonlocal pulled
        pcfg = pp.PeerPrefixConfig(
            cfg.peer_prefix_trials, cfg.peer_prefix_len, kv_budget_tokens=cfg.peer_prefix_budget_tokens, seed=args.seed
        )
        r = pp.run(model_dir, pcfg, logs / "peer_prefix")
        pulled = {**r.keys(), "config": asdict(pcfg), "modes": {m: x.as_dict() for m, x in r.modes.items()}}

    def disagg() -> None:
        from benchmarks import disagg as pd

        nonlocal split
        pcfg = pd.PdConfig(
            tuple(
                pd.scales(
                    cfg.pd_window_s,
                    cfg.pd_light_window_s,
                    cfg.pd_real_window_s,
                    cfg.pd_decode_streams,
                    cfg.pd_long_prompt_len,
                    cfg.pd_real_long_prompt_len,
                )
            ),
            pd.FitConfig.sized(pd.PdWorkload.sized(cfg.pd_long_prompt_len).chunk_tokens, cfg.pd_fit_reps),
            seed=args.seed,
        )
        r = pd.run(model_dir, pcfg, logs / "disagg")
        split = {**r.keys(), **r.as_dict()}
        errors.extend(f"disagg: {e}" for e in r.errors)

    def reattach() -> None:
        from benchmarks import reattach as ra

        nonlocal reattached
        reattached = ra.run(
            model_dir,
            ra.ReattachConfig(
                requests=cfg.reattach_requests,
                rounds=cfg.reattach_rounds,
                failover_rounds=cfg.reattach_failover_rounds,
                step_ms=cfg.reattach_step_ms,
            ),
            logs / "reattach",
        )
        errors.extend(f"reattach: {e}" for e in reattached.errors)

    def sampling_cost() -> None:
        from benchmarks import sampling_cost as sc

        nonlocal sampling
        sampling = sc.run(
            model_dir,
            sc.SamplingConfig(batches=cfg.sampling_batches, reps=cfg.sampling_reps),
            short.steps,
            args.threads,
            hf_model,
        )

    def logprobs_cost() -> None:
        from benchmarks import logprobs_cost as lc

        nonlocal logprobs
        deployment = stacks.get(aux_stack(logs), logs / "aux")
        logprobs = asdict(
            lc.run(model_dir, deployment, lc.LogprobsConfig(requests=cfg.logprobs_requests, rounds=cfg.logprobs_rounds))
        )

    def structured_cost() -> None:
        from benchmarks import structured as so

        nonlocal structured
        structured = so.run(
            model_dir, stacks.get(aux_stack(logs), logs / "aux"), so.StructuredConfig(rounds=cfg.structured_rounds)
        )

    def lora_cost() -> None:
        from benchmarks import lora_cost as lc

        nonlocal lora
        lcfg = lc.LoraCostConfig(requests=cfg.lora_requests, rounds=cfg.lora_rounds)
        (logs / "lora").mkdir(parents=True, exist_ok=True)
        deployment = stacks.get(lc.stack_config(logs / "lora", lcfg), logs / "lora")
        lora = lc.run(model_dir, deployment, logs / "lora", lcfg)

    def parallel_sampling() -> None:
        from benchmarks import parallel

        nonlocal par
        par = parallel.run(
            model_dir,
            stacks.get(aux_stack(logs), logs / "aux"),
            ParallelConfig(prompt_len=cfg.parallel_prompt_len, output_len=cfg.parallel_output_len, seed=args.seed),
        )
        errors.extend(par.errors)

    def shared_prefix() -> None:
        from benchmarks import shared_prefix as sp

        nonlocal shared
        shared = sp.serve(model_dir, spc, per_token, logs / "shared_prefix", stacks)
        errors.extend(shared.errors)

    def shared_prefix_hf() -> None:
        from benchmarks import shared_prefix as sp

        if shared is None:
            raise RuntimeError("its pagedserve runs failed: nothing to compare with")
        sp.hf_continuous(shared, spc, hf_model())

    def vllm_arm() -> None:
        nonlocal peer
        run = long or short  # the long workload's budget: vLLM's start (minutes) is paid once
        peer = vllm_peer.run(
            vllm_peer.PeerConfig(
                model_dir,
                run.budget_tokens,
                per_token,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=lens.get(run.budget_tokens, cfg.long_max_total_len + 16),
                venv=args.vllm_venv,
                rounds=args.vllm_rounds,
            ),
            short.workload,
            run.workload,
            logs / "vllm",
        )
        errors.extend(peer.errors)

    # Real deployments first, arms with equal flags one after the other so that they share one (the short run, the
    # shared-prefix arm's pagedserve run and the long run when they have one KV budget; the logprobs, structured and
    # parallel arms); then the stub executors' arms; then transformers, in this process.
    if "pagedserve" in cfg.arms:
        attempt("pagedserve (+ preemption probe)", paged, share=True)
    if "shared_prefix" in cfg.arms:
        attempt("shared prefix: pagedserve (caching on, off)", shared_prefix, share=True)
    if long is not None and "pagedserve" in cfg.arms:  # the long workload: the same arms on longer sequences
        attempt("long workload: pagedserve", lambda: long_paged(long))
    if "logprobs_cost" in cfg.arms:
        attempt("logprobs cost", logprobs_cost, share=True)
    if "structured" in cfg.arms:
        attempt("JSON-schema constraint cost", structured_cost, share=True)
    if "parallel" in cfg.arms:
        attempt("parallel sampling (n=8) KV blocks", parallel_sampling)
    if "lora" in cfg.arms:  # after the arms sharing the aux deployment: its own would end that one
        attempt("LoRA adapters: mixed and single-adapter throughput vs the base model", lora_cost)
    if "kv_spread" in cfg.arms:
        attempt("KV usage spread", kv_spread)
    if "migration" in cfg.arms:
        attempt("drain: KV migration against recompute", migration)
    if "spec_decode" in cfg.arms:
        attempt("speculative decoding (ngram, suffix) against none", spec_decode)
    if "peer_prefix" in cfg.arms:
        attempt("peer prefix: a cached prefix pulled from a peer against recomputed", peer_prefix)
    if "disagg" in cfg.arms:
        attempt("prefill and decode executors against mixed ones", disagg)
    if "overhead" in cfg.arms:
        attempt("scheduler overhead sweep", sweep)
    if "scale_out" in cfg.arms:
        attempt("scale-out sweep", scale_out)
    if "reattach" in cfg.arms:
        attempt("reattach latency", reattach)
    if "sampling_cost" in cfg.arms:  # after pagedserve: its step log gives the decode forward per batch
        attempt("seeded sampling cost", sampling_cost)
    if "hf_static" in cfg.arms:
        attempt("HF static", lambda: hf_static(short, hf_model(), None))
    if "hf_continuous" in cfg.arms:
        attempt("HF continuous", lambda: hf_continuous(short, hf_model(), args))
    if long is not None and "hf_static" in cfg.arms:
        attempt("long workload: HF static", lambda: hf_static(long, hf_model(), cfg.long_static_requests))
    if long is not None and "hf_continuous" in cfg.arms:
        attempt("long workload: HF continuous", lambda: hf_continuous(long, hf_model(), args))
    if "shared_prefix" in cfg.arms:
        attempt("shared prefix: HF continuous with block sharing", shared_prefix_hf)
    if "vllm" in cfg.arms:
        attempt("vLLM (CPU build) against pagedserve, one door", vllm_arm)
    stacks.close()
    hf_model.cache_clear()

    arms, steps, ratio = short.arms, short.steps, short.ratio
    kv_util, paged_series = analysis.paged_utilization(steps)
    tps = short.tokens_per_s()
    long_util, long_series = analysis.paged_utilization(long.steps if long else [])
    long_keys = long_summary(long, long_util)
    ovh_keys = overhead_keys(overhead)
    spec_keys = spec.keys() if spec else SpecBenchResult.empty_keys()
    top = max((p for p in overhead if p.loop == "pipelined"), key=lambda p: (p.running, p.waiting), default=None)
    share = analysis.overhead_share(steps)
    targets = [
        analysis.Target("throughput vs HF static", ">= 2x", ratio("hf_static"), 2.0, True, "x"),
        analysis.Target("throughput vs HF continuous", ">= 1.5x", ratio("hf_continuous"), 1.5, True, "x"),
        analysis.Target("KV utilization (steady state)", ">= 0.95", kv_util, 0.95, True),
        analysis.Target(
            f"scheduler overhead p50 (executor's wait between steps, pipelined) @ "
            f"{top.running if top else '-'} running / {top.waiting if top else '-'} waiting",
            "<= 2 ms",
            top.p50_ms if top else None,
            2.0,
            False,
            " ms",
        ),
        analysis.Target(
            "executor duty cycle @ 256 running (stub, pipelined)",
            ">= 0.95",
            ovh_keys["executor_duty_cycle_256"],
            0.95,
            True,
        ),  # type: ignore[arg-type]
        analysis.Target("overhead share of step time (real run)", "<= 0.10", share, 0.10, False),
        analysis.Target("scale-out efficiency at 4 executors", ">= 0.85", efficiency(scale, 4), 0.85, True),
        analysis.Target(
            "throughput vs HF continuous, long workload",
            ">= 1.5x",
            long_keys["throughput_ratio_vs_hf_continuous_long"],
            1.5,
            True,
            "x",
        ),
        analysis.Target(
            "KV utilization (steady state), long workload",
            ">= 0.95",
            long_keys["kv_utilization_steady_state_long"],
            0.95,
            True,
        ),
        analysis.Target(
            "throughput vs HF continuous (block sharing), shared prefix",
            ">= 2x",
            shared.ratio() if shared else None,
            2.0,
            True,
            "x",
        ),
        analysis.Target(
            "prefill tokens computed, caching on / off, shared prefix",
            "<= 0.2",
            shared.prefill_ratio() if shared else None,
            0.2,
            False,
        ),
        analysis.Target("KV blocks at peak, n=8 / 8 requests", "<= 0.3", par.ratio() if par else None, 0.3, False),
        analysis.Target(
            "drain stall p50, KV migration / recompute",
            "<= 0.25",
            (moved or {}).get("migration_stall_ratio"),  # type: ignore[arg-type]
            0.25,
            False,
        ),
        analysis.Target(
            "TTFT p50, 1,024-token prefix pulled from a peer / recomputed",
            "<= 0.5",
            (pulled or {}).get("peer_prefix_ttft_ratio"),  # type: ignore[arg-type]
            0.5,
            False,
        ),
        analysis.Target(
            "decode ITL p99, 1 prefill + 1 decode / 2 mixed executors (modelled)",
            "<= 0.5",
            (split or {}).get("pd_itl_p99_ratio"),  # type: ignore[arg-type]
            0.5,
            False,
        ),
        analysis.Target(
            "throughput vs vLLM (CPU build), long workload, one HTTP client",
            ">= 1.0x",
            peer.ratio("long", "output_tokens_per_s") if peer else None,
            1.0,
            True,
            "x",
        ),
        analysis.Target(
            "ITL p50 vs vLLM (CPU build), long workload",
            "<= 1.0x",
            peer.ratio("long", "itl_ms", pct="p50") if peer else None,
            1.0,
            False,
            "x",
        ),
        analysis.Target(
            "speculative decoding, output tok/s on / off, batch 1 (the better proposer)",
            ">= 1.8x",
            spec.best_batch1() if spec else None,
            1.8,
            True,
            "x",
        ),
        analysis.Target(
            f"speculative decoding, output tok/s on / off, batch {cfg.spec_batch} (the proposer that gains least)",
            ">= 0.95x",
            spec.least_batch_n() if spec else None,
            0.95,
            True,
            "x",
        ),
    ]
    plots = {
        "throughput": report.plot_throughput(arms, out),
        "latency": report.plot_latency(arms, out),
        "kv_utilization": report.plot_kv(paged_series, short.static_series, out),
        "scheduler_overhead": report.plot_overhead(overhead, out),
        "step_breakdown": report.plot_steps(steps, out),
        "preemption": report.plot_preemption(preemption, out),
        "scale_out": report.plot_scale_out(scale, out),
        "kv_spread": report.plot_kv_spread(spread, out),
        "streams": report.plot_streams(reattached, out),
    }
    if peer is not None and (vllm_png := vllm_peer.plot(peer, out)):
        plots["vllm"] = vllm_png
    if long is not None:
        plots["kv_utilization_long"] = report.plot_kv(long_series, long.static_series, out, "kv_utilization_long.png")
    re_dict = reattached.as_dict() if reattached else None
    summary = {
        "output_tokens_per_s": tps,
        "throughput_ratio_vs_hf_static": ratio("hf_static"),
        "throughput_ratio_vs_hf_continuous": ratio("hf_continuous"),
        "kv_utilization_steady_state": kv_util,
        "static_allocation_utilization": short.static_util,
        **ovh_keys,
        "scheduler_overhead_share_real_run": share,
        **long_keys,
        "throughput_ratio_vs_hf_continuous_shared_prefix": shared.ratio() if shared else None,
        "prefill_tokens_ratio_shared_prefix": shared.prefill_ratio() if shared else None,
        "shared_prefix": shared.as_dict() if shared else None,
        "n8_block_ratio": par.ratio() if par else None,
        "parallel_sampling": par.as_dict() if par else None,
        "workload": short.workload.describe(),
        "model": str(model_dir),
        "kv_budget_bytes": short.budget_bytes,
        "kv_budget_tokens": cfg.kv_budget_tokens,
        "kv_bytes_per_token": per_token,
        "threads": args.threads,
        "config": cfg.name,
        "arms": arms,
        "overhead_sweep": report.overhead_dicts(overhead),
        "preemption": [asdict(p) for p in preemption],
        "scale_out": [asdict(p) for p in scale],
        "scale_out_config": asdict(scale_cfg),
        "scale_out_efficiency_4": efficiency(scale, 4),
        "scale_out_efficiency_8": efficiency(scale, 8),
        "kv_usage_spread": spread.as_dict() if spread else None,
        "migration": moved,
        **{k: (moved or {}).get(k) for k in MIGRATION_KEYS},
        **spec_keys,
        "spec_decode": spec.as_dict() if spec else None,
        "peer_prefix": pulled,
        **{k: (pulled or {}).get(k) for k in PEER_PREFIX_KEYS},
        "disagg": {k: v for k, v in (split or {}).items() if k not in PD_KEYS} or None,
        **{k: (split or {}).get(k) for k in PD_KEYS},
        "reattach": re_dict,
        "reattach_ms_p50": re_dict["reattach_ms"]["p50"] if re_dict else None,
        "reattach_ms_p99": re_dict["reattach_ms"]["p99"] if re_dict else None,
        "failover_resume_ms_p50": re_dict["failover_resume_ms"]["p50"] if re_dict else None,
        "failover_resume_ms_p99": re_dict["failover_resume_ms"]["p99"] if re_dict else None,
        "sampling_cost": [asdict(p) for p in sampling],
        "seeded_sampling_cost_ratio": ratio_at(sampling),
        "seeded_sampling_share_of_forward": share_at(sampling),
        "logprobs_cost": logprobs,
        "logprobs_top5_tokens_per_s_ratio": logprobs["ratio"] if logprobs else None,
        "structured_output": structured.as_dict() if structured else None,
        "json_schema_tokens_per_s_ratio": structured.ratio if structured else None,
        "json_schema_mask_fill_us_per_token": structured.mask_fill_ms_per_token * 1e3 if structured else None,
        "json_schema_mask_apply_ms_per_step": structured.mask_apply_ms_per_step if structured else None,
        "lora_cost": lora.as_dict() if lora else None,
        "lora_mixed_throughput_ratio": lora.mixed_ratio if lora else None,
        "lora_single_adapter_throughput_ratio": lora.single_ratio if lora else None,
        **(peer or PeerResult(skipped="not in --arms")).summary_keys(),
        "throughput_ratio_vs_hf_continuous_previous": PREVIOUS_QUICK.ratio("hf_continuous"),
        "previous_run": {"label": PREVIOUS_QUICK.label, "output_tokens_per_s": PREVIOUS_QUICK.output_tokens_per_s},
        "targets": [t.as_dict() for t in targets],
        "plots": plots,
        "errors": errors,
        "wall_time_s": time.monotonic() - started,
        "arm_wall_time_s": walls,
        "deployments_started": stacks.started,
    }
    report.write_summary(summary, out)
    report.write_markdown(summary, arms, targets, overhead, preemption, plots, out, scale=scale, sampling=sampling)
    report.append_lines(vllm_peer.section(summary), out)
    report.append_lines(spec_section(summary), out)
    return summary


def write_steps(steps: list[dict[str, float]], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in steps))
