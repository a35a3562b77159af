"""PNG plots, ``summary.json`` and ``report.md`` from one benchmark run's results."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from benchmarks.analysis import Series, Target  # noqa: E402
from benchmarks.kv_spread import SpreadResult  # noqa: E402
from benchmarks.overhead import OverheadPoint  # noqa: E402
from benchmarks.preemption import PreemptionPoint  # noqa: E402
from benchmarks.reattach import ReattachResult  # noqa: E402
from benchmarks.sampling_cost import RATIO_BATCH, SamplingPoint  # noqa: E402
from benchmarks.scale_out import ScaleOutPoint  # noqa: E402

ARMS = ("pagedserve", "hf_static", "hf_continuous")


def _save(fig: plt.Figure, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plot_throughput(arms: dict[str, dict], out: Path) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [a for a in ARMS if a in arms]
    for ax, key, label in zip(axes, ("output_tokens_per_s", "requests_per_s"), ("output tokens/s", "requests/s")):
        ax.bar(names, [arms[a][key] for a in names], color=["tab:green", "tab:gray", "tab:blue"][: len(names)])
        ax.set_ylabel(label)
    fig.suptitle("Throughput, same model, workload and KV budget")
    return _save(fig, out / "throughput.png")


def plot_latency(arms: dict[str, dict], out: Path) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = [a for a in ARMS if a in arms]
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
        for i, q in enumerate(("p50", "p90", "p99")):
            ax.bar(
                [j + 0.27 * (i - 1) for j in range(len(names))],
                [arms[a][metric][q] or 0 for a in names],
                width=0.27,
                label=q,
            )
        ax.set_xticks(range(len(names)), names)
        ax.set_title(metric.replace("_ms", "").upper() + " (ms)")
    axes[0].legend()
    return _save(fig, out / "latency.png")


def plot_kv(paged: Series, static: Series, out: Path, name: str = "kv_utilization.png") -> str:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(paged.t, paged.util, label="pagedserve: live / allocated slots", lw=1)
    ax.plot(static.t, static.util, label="static max-length allocation (HF static batches)", lw=1)
    ax.set_xlabel("fraction of the run")
    ax.set_ylabel("KV slots holding live tokens")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower left")
    return _save(fig, out / name)


def plot_overhead(points: list[OverheadPoint], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    for loop in sorted({p.loop for p in points}):
        for waiting in sorted({p.waiting for p in points if p.loop == loop}):
            pts = sorted((p for p in points if p.waiting == waiting and p.loop == loop), key=lambda p: p.running)
            ax.plot(
                [p.running for p in pts], [p.p50_ms for p in pts], marker="o", label=f"{loop}: p50, {waiting} waiting"
            )
            ax.plot(
                [p.running for p in pts],
                [p.p99_ms for p in pts],
                ls="--",
                marker="x",
                label=f"{loop}: p99, {waiting} waiting",
            )
    ax.axhline(2.0, color="red", lw=0.8, label="target p50 2 ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("running requests")
    ax.set_ylabel("executor's wait between steps, ms (stub)")
    ax.legend(fontsize=7)
    return _save(fig, out / "scheduler_overhead.png")


def plot_steps(steps: list[dict[str, float]], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    if steps:
        t0 = steps[0]["t"]
        t = [r["t"] - t0 for r in steps]
        fwd = [r["forward_ms"] for r in steps]
        other = [r["schedule_ms"] + r["redis_ms"] + r["executor_ms"] - r["forward_ms"] for r in steps]
        ax.stackplot(t, fwd, other, labels=["executor forward", "outside forward (schedule, Redis, gRPC)"])
        ax2 = ax.twinx()
        ax2.plot(t, [r["running"] for r in steps], color="k", lw=0.8, label="running")
        ax2.set_ylabel("running sequences")
        ax.legend(loc="upper right", fontsize=7)
    ax.set_xlabel("s")
    ax.set_ylabel("ms per step")
    return _save(fig, out / "step_breakdown.png")


def plot_preemption(points: list[PreemptionPoint], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = [p.tokens for p in points]
    ax.plot(n, [p.recompute_ms for p in points], marker="o", label="recompute (re-prefill)")
    ax.plot(n, [p.swap_ms for p in points], marker="s", label="swap out + in")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("ms per preempted request")
    if points:  # an arm that did not run leaves an empty, linear plot
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend()
    return _save(fig, out / "preemption.png")


def plot_scale_out(points: list[ScaleOutPoint], out: Path) -> str:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    pts = sorted(points, key=lambda p: p.executors)
    n = [p.executors for p in pts]
    one = next((p.tokens_per_s for p in pts if p.executors == 1), None)
    ax.plot(n, [p.tokens_per_s for p in pts], marker="o", label="measured")
    if one:
        ax.plot(n, [k * one for k in n], ls="--", color="gray", label="ideal: N x (1 executor)")
    ax.plot(
        n, [p.ideal_tokens_per_s for p in pts], ls=":", color="k", lw=0.8, label="N x running / step time (duty 1.0)"
    )
    ax.set_xlabel("executors (2 scheduler replicas)")
    ax.set_ylabel("tokens/s, all executors")
    for p in pts:
        ax2.scatter([p.executors] * len(p.duty_cycles), p.duty_cycles, s=12, color="tab:blue", alpha=0.6)
    ax2.plot(n, [p.mean_duty for p in pts], marker="o", color="tab:orange", label="mean")
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("executors")
    ax2.set_ylabel("duty cycle (time in Step / wall time)")
    if pts:  # an arm that did not run leaves empty, linear plots
        for a in (ax, ax2):
            a.set_xscale("log", base=2)
            a.set_xticks(n, [str(k) for k in n])
        ax.legend(fontsize=7)
        ax2.legend(fontsize=7)
    fig.suptitle("Scale-out: stub executors with a simulated step, real schedulers and Redis")
    return _save(fig, out / "scale_out.png")


def plot_kv_spread(spread: SpreadResult | None, out: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    series = spread.series if spread else {}
    t0 = min((s[0][0] for s in series.values() if s), default=0.0)
    for i, (eid, s) in enumerate(sorted(series.items())):
        ax.plot([t - t0 for t, _ in s], [f for _, f in s], lw=1, label=f"executor {i} ({eid[:8]})")
    ax.set_xlabel("s")
    ax.set_ylabel("device KV blocks used (fraction)")
    ax.set_ylim(0, 1.05)
    if series:
        ax.legend(fontsize=7)
    return _save(fig, out / "kv_spread.png")


def _cdf(ax: plt.Axes, xs: list[float], label: str) -> None:
    if xs:
        ys = sorted(xs)
        ax.step(ys, [(i + 1) / len(ys) for i in range(len(ys))], where="post", label=f"{label} ({len(ys)})")


def plot_streams(result: ReattachResult | None, out: Path) -> str:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    if result is not None:
        _cdf(ax, [s.reattach_ms for s in result.samples], "Resume -> first replayed token")
        _cdf(ax, [s.first_live_ms for s in result.samples if s.first_live_ms is not None], "-> first live token")
        _cdf(ax2, [ms for r in result.failover for ms in r.survivor_ms], "loop on the surviving replica")
        _cdf(ax2, [ms for r in result.failover for ms in r.handover_ms], "loop on the killed replica (handover)")
    ax.set_title("reattach on another replica")
    ax2.set_title("SIGKILL of the replica -> next token (client library)")
    for a in (ax, ax2):
        a.set_xlabel("ms")
        a.set_ylabel("fraction of streams")
        a.set_ylim(0, 1.02)
        if a.lines:  # an arm that did not run leaves empty, linear plots
            a.set_xscale("log")
            a.xaxis.set_major_formatter(ScalarFormatter())
            a.xaxis.set_minor_formatter(NullFormatter())
            a.legend(fontsize=7)
    return _save(fig, out / "streams.png")


def _clean(x: object) -> object:
    """JSON without NaN: missing figures are null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_summary(summary: dict[str, object], out: Path) -> None:
    (out / "summary.json").write_text(json.dumps(_clean(summary), indent=2) + "\n")


def _f(x: object, nd: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _scale_out_lines(summary: dict, points: list[ScaleOutPoint], plots: dict[str, str]) -> list[str]:
    c = summary.get("scale_out_config") or {}
    one = next((p.tokens_per_s for p in points if p.executors == 1), None)
    lines = [
        "## Scale-out (stub executors, 2 scheduler replicas)",
        "",
        f"Stub executors with a {c.get('step_ms')} ms simulated step and {c.get('running')} running each, "
        f"registered in Redis; {c.get('replicas')} real scheduler_svc replicas spread one loop per executor; "
        f"{c.get('window_s')} s window once every executor runs {c.get('running')}. Efficiency = tokens/s / "
        f"(N x tokens/s at 1). Duty = time inside the stub's Step / wall time. Loop time = schedule + Redis + "
        "gRPC beyond the stub's own time, per step. CPU in cores (of this machine's "
        f"{os.cpu_count()}) over the window; `other` is whatever else ran on the machine.",
        "",
        "| executors | steps/s | tokens/s | efficiency | mean duty (min-max) | loop ms p50 (sched / Redis / "
        "gRPC) | loops per replica | CPU client / frontends / loops / stubs / Redis / other | busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(points, key=lambda p: p.executors):
        eff = p.tokens_per_s / (p.executors * one) if one else None
        cpu = " / ".join(_f(p.cpu_cores.get(k), 2) for k in ("client", "frontends", "loops", "stubs", "redis", "other"))
        lines.append(
            f"| {p.executors} | {_f(p.steps_per_s)} | {_f(p.tokens_per_s, 0)} | {_f(eff, 3)} | "
            f"{_f(p.mean_duty, 2)} ({_f(min(p.duty_cycles, default=None), 2)}-"
            f"{_f(max(p.duty_cycles, default=None), 2)}) | {_f(p.overhead_ms_p50, 1)} "
            f"({_f(p.schedule_ms_p50, 1)} / {_f(p.redis_ms_p50, 1)} / {_f(p.rpc_ms_p50, 1)}) | "
            f"{'+'.join(map(str, p.loops_per_replica))} | {cpu} | {_f(p.machine_busy, 2)} |"
        )
    sp = summary.get("kv_usage_spread") or {}
    lines += [
        "",
        f"Efficiency at 4 executors: **{_f(summary.get('scale_out_efficiency_4'), 3)}**, at 8: "
        f"**{_f(summary.get('scale_out_efficiency_8'), 3)}**.",
        "",
        f"![scale-out]({plots.get('scale_out', '')})",
        "",
        "## KV usage spread (real executors, uniform load)",
        "",
        f"{sp.get('executors', '–')} executors with the same KV budget, one scheduler; device-used fraction per "
        "executor sampled from the namespace's `usage` hash every 0.2 s; spread = max - min across executors "
        f"over the middle 80% of the run: mean **{_f(sp.get('mean'), 3)}**, max **{_f(sp.get('max'), 3)}** "
        f"({sp.get('samples', 0)} samples, mean used {_f(sp.get('mean_used'), 2)}); while requests wait in "
        f"the queue: mean {_f(sp.get('loaded_mean'), 3)}, max {_f(sp.get('loaded_max'), 3)}.",
        "",
        f"![kv spread]({plots.get('kv_spread', '')})",
        "",
    ]
    return lines


def _previous_run_line(summary: dict) -> str:
    prev = summary.get("previous_run") or {}
    then = prev.get("output_tokens_per_s") or {}
    now = summary.get("throughput_ratio_vs_hf_continuous")
    caveat = "" if summary.get("config") == "quick" else " (that was the quick configuration, this is not)"
    return (
        f"Against the {prev.get('label', 'previous run')}, SmolLM2-135M{caveat}: pagedserve / HF continuous "
        f"**{_f(now, 3)}x** now vs **{_f(summary.get('throughput_ratio_vs_hf_continuous_previous'), 3)}x** then "
        f"(pagedserve {then.get('pagedserve')}, HF continuous {then.get('hf_continuous')}, HF static "
        f"{then.get('hf_static')} tok/s then; vs HF static {_f(summary.get('throughput_ratio_vs_hf_static'), 2)}x "
        "now). What offsets and replayable seeds cost shows as a change of the ratio; tokens/s move with the "
        "machine, and run-to-run noise on a shared 2-core box is about 20%."
    )


def _streams_lines(summary: dict, sampling: list[SamplingPoint], plots: dict[str, str]) -> list[str]:
    ra = summary.get("reattach") or {}
    c = ra.get("config") or {}
    lines = [
        "## Streams: reattach, failover, replayable seeds",
        "",
        f"{c.get('executors', '–')} stub executors ({c.get('step_ms', '–')} ms simulated step), 2 real scheduler "
        f"replicas A and B (`--lease-ms {c.get('lease_ms', '–')}`). "
        f"**Reattach** ({c.get('rounds', '–')} x {c.get('requests', '–')} "
        "samples): per round, that many long requests through A; once each has generated "
        f"{c.get('warm_tokens', '–')} tokens, one at a time, `Resume(request_id, offset = half of what it has "
        "generated)` on B over a fresh connection; time from the call to the first response carrying tokens "
        f"(the replay from Redis, {_f(ra.get('replayed_tokens_mean'))} tokens on average), and to the next one "
        f"(the first live token). **Failover** ({c.get('failover_rounds', '–')} x "
        f"{c.get('requests', '–')}): per round, that many streams through `pagedserve.client.generate([A, B])`, "
        "A's API and loop "
        "processes SIGKILLed; per stream, from the kill to the first token past what Redis held just after it. "
        "That includes the client noticing UNAVAILABLE, the library's backoff (0.2 s, A once more, 0.4 s, then "
        "B) and the Resume; for requests on an executor whose loop A led, also the lease handover (B's manager "
        "takes the loop once A's lease expires) and the loop's restore from Redis.",
        "",
        "| figure | samples | p50 ms | p99 ms | mean ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    rows = [
        ("reattach: Resume on B -> first replayed token", "reattach_ms"),
        ("reattach: -> first live token after the replay", "first_live_ms"),
        ("failover: kill -> next token, every stream", "failover_resume_ms"),
        ("failover: its executor's loop on the surviving replica", "failover_survivor_loop_ms"),
        ("failover: its executor's loop on the killed replica (handover)", "failover_handover_ms"),
    ]
    for label, key in rows:
        st = ra.get(key) or {}
        lines.append(
            f"| {label} | {st.get('n', '–')} | {_f(st.get('p50'))} | {_f(st.get('p99'))} | "
            f"{_f(st.get('mean'))} | {_f(st.get('max'))} |"
        )
    cpu = ra.get("cpu_cores") or {}
    lines += [
        "",
        f"Loops the killed replica led at each kill: {ra.get('failover_loops_on_killed', '–')}; streams that "
        f"did not move on: {ra.get('failover_lost', '–')}. CPU over the reattach rounds: "
        f"{_f(cpu.get('deployment'), 2)} cores for the harness and the deployment, {_f(cpu.get('other'), 2)} for "
        f"anything else on the machine (of {os.cpu_count()}).",
        "",
        f"![streams]({plots.get('streams', '')})",
        "",
        "Replayable seeds on the executor: `executor_svc.sampler.sample` on fp32 logits of the model's "
        "vocabulary, temperature 0.8, top-k 50, every row seeded (every sampled request today) vs none (an "
        "unseeded request before); median ms per call. Unseeded calls are timed twice, interleaved: their ratio "
        "(A/A) is the noise floor of the comparison. The decode forward at the same batch comes from the "
        "pagedserve run's step log (a local fit over decode-only steps near that batch; that arm samples "
        "greedily) or, where it has none, from a decode forward of the model measured here.",
        "",
        "| batch | vocab | unseeded ms | seeded ms | seeded / unseeded | A/A | seeds' extra ms | decode forward ms "
        "| seeds / forward | sampling / forward | forward from |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sampling:
        lines.append(
            f"| {p.batch} | {p.vocab} | {_f(p.unseeded_ms, 2)} | {_f(p.seeded_ms, 2)} | {_f(p.ratio, 3)} | "
            f"{_f(p.noise_ratio, 3)} | "
            f"{_f(p.extra_ms, 2)} | {_f(p.forward_ms)} | {_pct(p.seeds_share_of_forward)} | "
            f"{_pct(p.sampling_share_of_forward)} | {p.forward_source or '–'} |"
        )
    lines += [
        "",
        f"Seeded / unseeded at batch {RATIO_BATCH}: **{_f(summary.get('seeded_sampling_cost_ratio'), 3)}**; "
        f"the seeds cost **{_pct(summary.get('seeded_sampling_share_of_forward'))}** of a decode step's forward "
        "there.",
        "",
    ]
    return lines


def _arrivals(rate: float | None) -> str:
    return f"Poisson {rate:.2f} req/s" if rate else "all at once"


def _trio(arm: dict, key: str) -> str:
    return "/".join(_f(arm[key][q], 0) for q in ("p50", "p90", "p99"))


def _pct(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _workload_line(w: dict) -> str:
    return (
        f"Workload: {w['distribution']} (scale {w['scale']}), {w['num_requests']} requests, "
        f"prompt mean {w['prompt_len_mean']:.1f} / max {w['prompt_len_max']}, output mean "
        f"{w['output_len_mean']:.1f} / max {w['output_len_max']}, arrivals {_arrivals(w['rate'])}, "
        f"seed {w['seed']}, ignore_eos."
    )


def _arm_table(arms: dict[str, dict]) -> list[str]:
    lines = [
        "| arm | out tok/s | req/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | E2E p50/p90/p99 ms | "
        "peak / mean seqs |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in (a for a in ARMS if a in arms):
        a = arms[name]
        lines.append(
            f"| {name} | {_f(a['output_tokens_per_s'])} | {_f(a['requests_per_s'], 2)} | "
            f"{_trio(a, 'ttft_ms')} | {_trio(a, 'tpot_ms')} | {_trio(a, 'e2e_ms')} | {a['peak_concurrent_seqs']} / "
            f"{_f(a['mean_concurrent_seqs'])} |"
        )
    return lines


def _long_lines(summary: dict, plots: dict[str, str]) -> list[str]:
    """The long workload's section: the short run's table and KV figures, on ShareGPT x 0.5 lengths."""
    lg = summary.get("long")
    if not lg:
        return []
    arms = lg["arms"]
    n_static, n_all = lg.get("hf_static_requests"), lg["workload"]["num_requests"]
    subset = (
        (
            f" (HF static served only the first {n_static} of the {n_all} requests, to fit the run's time: its "
            "tokens/s are those requests')"
        )
        if n_static is not None and n_static < n_all
        else ""
    )
    return [
        "## Long workload",
        "",
        f"The same arms after the short run, on longer sequences: KV budget {lg['kv_budget_bytes']:,} bytes "
        f"({lg['kv_budget_tokens']} tokens) for every arm.",
        "",
        _workload_line(lg["workload"]),
        "",
        *_arm_table(arms),
        "",
        f"pagedserve / HF continuous **{_f(summary.get('throughput_ratio_vs_hf_continuous_long'), 3)}x**, "
        f"/ HF static **{_f(summary.get('throughput_ratio_vs_hf_static_long'), 3)}x**{subset}. KV utilization "
        f"(steady state): **{_f(summary.get('kv_utilization_steady_state_long'), 3)}**; static max-length "
        f"allocation: **{_f(lg.get('static_allocation_utilization'), 3)}**.",
        "",
        f"![kv long]({plots.get('kv_utilization_long', '')})",
        "",
    ]


def _moves_lines(summary: dict) -> list[str]:
    """KV that moves between executors: the drain arm (benchmarks/migration.py) and the peer prefix arm
    (benchmarks/peer_prefix.py), each against recompute."""
    moved, pulled = summary.get("migration"), summary.get("peer_prefix")
    if not moved and not pulled:
        return []
    lines = ["## KV that moves between executors", ""]
    if moved:
        kv, rc = moved["modes"].get("kv", {}), moved["modes"].get("recompute", {})
        lines += [
            "Drain of the busier of 2 executors holding long-context streams (SIGTERM; stall = the longest gap in "
            "a moved stream from the SIGTERM on):",
            "",
            "| mode | stall p50 ms | drain s (exit) | resumed s | recomputed tokens | bytes moved | streams moved |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {m['mode']} | {_f(m.get('stall_p50_ms'))} | {_f(m.get('drain_s'), 2)} | "
                f"{_f(m.get('resumed_s'), 2)} | "
                f"{m.get('recomputed_tokens')} | {m.get('migrated_bytes'):,} | {m.get('moved')} |"
                for m in (kv, rc)
                if m
            ),
            "",
            f"Stall ratio **{_f(moved.get('migration_stall_ratio'), 3)}**; the streams' tokens are the same in "
            f"both modes: {moved.get('migration_tokens_identical')}.",
            "",
        ]
    if pulled:
        pull, rc = pulled["modes"].get("pull", {}), pulled["modes"].get("recompute", {})
        lines += [
            "A request whose prefix a busy peer caches, placed on the idle executor (TTFT from the call):",
            "",
            "| mode | TTFT p50 ms | TTFT per probe ms | blocks pulled | asks |",
            "|---|---|---|---|---|",
            *(
                f"| {m['mode']} | {_f(m.get('ttft_p50_ms'))} | {', '.join(_f(x) for x in m.get('ttft_ms', []))} | "
                f"{m.get('pulled_blocks')} | {m.get('asks')} |"
                for m in (pull, rc)
                if m
            ),
            "",
            f"TTFT ratio **{_f(pulled.get('peer_prefix_ttft_ratio'), 3)}**; the probes' tokens are the same in "
            f"both modes: {pulled.get('peer_prefix_tokens_identical')}.",
            "",
        ]
    return lines


def _disagg_lines(summary: dict) -> list[str]:
    """Prefill and decode executors against mixed ones (benchmarks/disagg.py): the fitted step model, then each
    scale's two runs side by side."""
    pd = summary.get("disagg")
    if not pd:
        return []
    lines = ["## Prefill and decode executors", ""]
    fit = pd.get("step_model")
    if fit:
        lines += [
            "Step-time model of the stub executors, fitted on this machine to a real executor's own step reports "
            f"(hand-made plans, median of reps; decode rows at {fit['context']} tokens of context, the prefill "
            f"chunk at position {fit['chunk_start']}): step ms = **{_f(fit['a_ms'], 2)} + "
            f"{_f(fit['b_ms_per_prefill_token'], 4)} x prefill tokens + {_f(fit['c_ms_per_decode_seq'], 3)} x "
            f"decode sequences** (least squares of the relative errors; R^2 {_f(fit['r2'], 4)}, largest error "
            f"{_pct(fit.get('max_rel_error'))} over {len(fit['points'])} points); a pull of n blocks from "
            f"a peer (real `ReadBlocks`, loopback): **{_f(fit['pull_fixed_ms'], 2)} + "
            f"{_f(fit['pull_ms_per_block'], 3)} x n** ms. The stubs sleep those times, so the modelled runs are "
            "two machines' worth of executors; the real runs share this machine's cores.",
            "",
        ]
    lines += [
        "| scale | mode | long prompt every s | tok/s | ITL p50 / p99 ms | decode streams' ITL p99 ms | "
        "TTFT long p50 ms | TTFT decode streams p50 ms | long prompts (started) | handed over |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scale, runs in pd.get("scales", {}).items():
        for mode, r in runs.items():
            lines.append(
                f"| {scale} | {mode} ({'+'.join(r['roles'])}) | {_f(r['long_every_s'], 2)} | "
                f"{_f(r['output_tokens_per_s'])} | {_f(r['itl_ms']['p50'])} / {_f(r['itl_ms']['p99'])} | "
                f"{_f(r['decode_stream_itl_ms']['p99'])} | {_f(r['ttft_long_ms']['p50'])} | "
                f"{_f(r['ttft_decode_stream_ms']['p50'])} | {r['long_requests']} ({r['long_requests_started']}) | "
                f"{r['counters'].get('migrations_disagg', 0)} |"
            )
    lines += [
        "",
        "Disaggregated / mixed, modelled: ITL p99 **"
        f"{_f(summary.get('pd_itl_p99_ratio'), 3)}**, throughput {_f(summary.get('pd_throughput_ratio'), 3)}, "
        f"long-prompt TTFT p50 {_f(summary.get('pd_ttft_p50_ratio'), 3)}; light long-prompt traffic: ITL p99 "
        f"{_f(summary.get('pd_itl_p99_ratio_light'), 3)}, throughput "
        f"{_f(summary.get('pd_throughput_ratio_light'), 3)}, TTFT p50 {_f(summary.get('pd_ttft_p50_ratio_light'), 3)}; "
        f"real model (both executors on this machine's cores): ITL p99 {_f(summary.get('pd_itl_p99_ratio_real'), 3)}"
        f", throughput {_f(summary.get('pd_throughput_ratio_real'), 3)}, TTFT p50 "
        f"{_f(summary.get('pd_ttft_p50_ratio_real'), 3)}.",
        "",
    ]
    return lines


def write_markdown(
    summary: dict,
    arms: dict[str, dict],
    targets: list[Target],
    overhead: list[OverheadPoint],
    preemption: list[PreemptionPoint],
    plots: dict[str, str],
    out: Path,
    scale: list[ScaleOutPoint] | None = None,
    sampling: list[SamplingPoint] | None = None,
) -> None:
    lines = [
        "# pagedserve benchmark",
        "",
        f"Model `{summary['model']}`; KV budget {summary['kv_budget_bytes']:,} bytes "
        f"({summary['kv_budget_tokens']} tokens at {summary['kv_bytes_per_token']} B/token) for every arm; "
        f"{summary['threads']} torch threads; config `{summary['config']}`; wall time {summary['wall_time_s']:.0f} s.",
        "",
        _workload_line(summary["workload"]),
        "",
        "## Targets",
        "",
        "| target | goal | measured | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {t.name} | {t.goal} | {_f(t.value, 3)}{t.unit} | {t.verdict()} |" for t in targets]
    lines += ["", "## Throughput and latency per arm", "", *_arm_table(arms)]
    lines += ["", _previous_run_line(summary)]
    for err in summary.get("errors", []):
        lines.append(f"\n**Arm failed:** {err}")
    lines += [
        "",
        f"![throughput]({plots.get('throughput', '')})",
        f"![latency]({plots.get('latency', '')})",
        "",
        "## KV cache utilization",
        "",
        f"pagedserve steady state (mean of live / allocated slots over the middle 80% of the run): "
        f"**{_f(summary['kv_utilization_steady_state'], 3)}**; static max-length allocation for the same "
        f"requests (HF static batches, rows of longest prompt + longest output): "
        f"**{_f(summary['static_allocation_utilization'], 3)}**.",
        "",
        f"![kv]({plots.get('kv_utilization', '')})",
        "",
        *_long_lines(summary, plots),
        "## Scheduler overhead (stub executor)",
        "",
        f"The stub simulates a {_f(summary.get('overhead_step_ms'), 0)} ms step. Gap = the executor's wait "
        "between two steps (the scheduler's critical path); duty = time inside steps / (that + the gaps); "
        "loop = the loop's own schedule + Redis time per step (off the critical path when pipelined); wait = "
        "serial: the Step round trip, pipelined: the wait for the oldest result.",
        "",
        f"Pipelined / serial at the target point: gap p50 x"
        f"{_f(summary.get('scheduler_overhead_ratio_pipelined_vs_serial'), 3)}, duty cycle x"
        f"{_f(summary.get('executor_duty_cycle_ratio_pipelined_vs_serial'), 3)}.",
        "",
        "| loop | running | waiting | steps | gap p50 ms | gap p99 ms | duty | loop p50 ms | Redis p50 | "
        "plan p50 | commit p50 | encode p50 | decode p50 | wait p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.loop} | {p.running} | {p.waiting} | {p.steps} | {_f(p.p50_ms, 2)} | {_f(p.p99_ms, 2)} | "
        f"{_f(p.duty_cycle, 3)} | {_f(p.schedule_p50_ms + p.redis_p50_ms, 2)} | {_f(p.redis_p50_ms, 2)} | "
        f"{_f(p.plan_p50_ms, 2)} | {_f(p.commit_p50_ms, 2)} | {_f(p.encode_p50_ms, 2)} | "
        f"{_f(p.decode_p50_ms, 2)} | {_f(p.rpc_p50_ms, 2)} |"
        for p in overhead
    ]
    lines += [
        "",
        f"![overhead]({plots.get('scheduler_overhead', '')})",
        "",
        f"Real run: **{_f(summary['scheduler_overhead_share_real_run'], 3)}** of step time is outside the "
        "executor's forward pass.",
        "",
        f"![steps]({plots.get('step_breakdown', '')})",
        "",
        "## Preemption cost",
        "",
        "Hand-made plans through the `Step` RPC of an executor of its own (the arm's flags, not registered, so no "
        "loop leads it), after the run: recompute = "
        "prefill of N tokens; swap = moving ceil(N/block) blocks device->CPU and back. Median of 3; "
        "RPC round trip (executor-side time in brackets).",
        "",
        "| tokens | blocks | recompute ms | swap out+in ms | out / in ms |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.tokens} | {p.blocks} | {_f(p.recompute_ms)} ({_f(p.recompute_executor_ms)}) | "
        f"{_f(p.swap_ms)} ({_f(p.swap_executor_ms)}) | {_f(p.swap_out_ms)} / {_f(p.swap_in_ms)} |"
        for p in preemption
    ]
    lines += ["", f"![preemption]({plots.get('preemption', '')})", ""]
    lines += _moves_lines(summary)
    lines += _disagg_lines(summary)
    lines += _scale_out_lines(summary, scale or [], plots)
    lines += _streams_lines(summary, sampling or [], plots)
    lines += _structured_lines(summary)
    (out / "report.md").write_text("\n".join(lines))


def _structured_lines(summary: dict) -> list[str]:
    so = summary.get("structured_output")
    if not so:
        return []
    return [
        "## Structured output",
        "",
        "One SmolLM2 deployment, batches of chat requests at once, greedy, alternating plain (`ignore_eos`, fixed "
        "length) and JSON-schema constrained (an array of a fixed number of enum strings, so about as long). "
        "The ratio compares full-batch decode steps (median interval in the step log, plain over JSON); the "
        "wall figures are each batch's output tokens over its wall time (benchmarks/structured.py).",
        "",
        "| step ms plain / JSON | tokens/s ratio | wall tok/s plain / JSON (ratio) | valid | mask fill per token "
        "(p50 / p99) | mask apply per step |",
        "|---|---|---|---|---|---|",
        f"| {_f(so['plain_step_ms'])} / {_f(so['json_step_ms'])} | **{_f(so['ratio'], 3)}** | "
        f"{_f(so['plain_tokens_per_s'])} / {_f(so['json_tokens_per_s'])} ({_f(so['wall_ratio'], 3)}) | "
        f"{so['valid']}/{so['constrained']} | {_f(so['mask_fill_ms_per_token'] * 1e3, 1)} / "
        f"{_f(so['mask_fill_ms_p99'] * 1e3, 1)} µs (worker thread, overlapped with the forward) | "
        f"{_f(so['mask_apply_ms_per_step'], 3)} ms |",
        "",
    ]


def overhead_dicts(points: list[OverheadPoint]) -> list[dict]:
    return [asdict(p) for p in points]


def plot_duty(series: list[dict], out: Path) -> str:
    """The executor's duty cycle (time inside Step / wall time) per number of running sequences, real run."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if series:
        running = [p["running"] for p in series]
        ax.plot(running, [p["duty"] for p in series], marker="o", ms=3, lw=1)
        ax2 = ax.twinx()
        ax2.bar(running, [p["steps"] for p in series], color="tab:gray", alpha=0.25, width=0.8)
        ax2.set_ylabel("steps")
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("running sequences")
    ax.set_ylabel("executor duty cycle")
    ax.set_title("pagedserve run: time inside Step / wall time, per step's running count", fontsize=9)
    return _save(fig, out / "duty_cycle.png")


def _per_batch(points: list[dict], theirs: str, name: str) -> list[str]:
    """The executor's step against a peer's, one row per batch size."""
    rows = [f"| {p['batch']} | {_f(p['executor_ms'])} | {_f(p[theirs])} | {_f(p['ratio'], 3)} |" for p in points]
    return [f"| batch | executor ms | {name} ms | executor / {name} |", "|---|---|---|---|", *rows]


def _machine_lines(summary: dict) -> list[str]:
    fl = summary.get("model_flops_per_token") or {}
    gemm = summary.get("gemm_flops_per_s")
    lines = [
        "",
        "## Against the machine",
        "",
        "Informational, no target. **Model-runner ratio**: the executor's own decode step (`Engine.step` in "
        "the harness process, a hand-made plan of one token per row behind "
        f"{(summary.get('model_runner') or [{}])[0].get('context', '–')} prefilled tokens) against "
        "transformers' eager decode step (the same weights, one token per row on a DynamicCache of as many "
        "tokens, plus the argmax), alternating; medians, ratio = median of the per-pair ratios.",
        "",
        *_per_batch(summary.get("model_runner") or [], "transformers_ms", "transformers"),
    ]
    vs = summary.get("runner_vs_vllm") or {}
    lines += [
        "",
        "**Against vLLM's engine step** on the same shapes (`benchmarks/vllm_steps.py`: vLLM's offline `LLM` in its "
        "own venv, threads bound as its server's; a decode step = (time of 1 + 16 tokens - time of 1 token) / 16, "
        "median of 3: its scheduler, model runner and output processing; ours is the executor's `Engine.step` "
        "above, forward and sampling, timed back to back after the pairs, as vLLM's is: no transformers forward "
        f"between two steps). vLLM's start: {_f(vs.get('vllm_startup_s'))} s."
        + (f" Not measured: {vs['skipped']}." if vs.get("skipped") else ""),
        "",
        *_per_batch(vs.get("points") or [], "vllm_step_ms", "vLLM"),
    ]
    fractions = summary.get("roofline_fraction_by_arm") or {}
    per_arm = ", ".join(f"{a} {_f(v, 3)}" for a, v in fractions.items()) or "–"
    lines += [
        "",
        f"**Roofline**: fp32 GEMM ({summary.get('gemm_size') or '–'}^2 `torch.mm`, "
        f"best of {summary.get('gemm_reps') or '–'}, "
        f"{summary.get('threads')} threads): **{_f(gemm / 1e9 if gemm else None)} GFLOP/s**. FLOPs per output "
        f"token = 2 x {fl.get('matmul_params', '–')} matmul parameters + 2 x 2 x {fl.get('layers', '–')} "
        f"layers x {_f(fl.get('context'))} context x {fl.get('hidden', '–')} hidden = "
        f"**{_f(fl['flops'] / 1e6 if fl else None)} MFLOP**. Output tokens/s x FLOPs/token / GEMM FLOP/s: "
        f"pagedserve **{_f(summary.get('roofline_fraction'), 3)}** (every arm: {per_arm}; prefill FLOPs not "
        "counted).",
        "",
        f"**Executor busy fraction** in the pagedserve run: **{_f(summary.get('executor_busy_fraction'), 3)}** "
        "(sum of the executor's own `step_ms` / the wall time its step log spans).",
        "",
        f"![duty cycle]({(summary.get('plots') or {}).get('duty_cycle', '')})",
        "",
    ]
    lines += [f"- error: {e}" for e in summary.get("errors") or [] if e.startswith(("machine:", "vllm steps:"))]
    return lines


def append_machine_section(summary: dict, out: Path) -> None:
    append_lines(_machine_lines(summary), out)


def append_lines(lines: list[str], out: Path) -> None:
    path = out / "report.md"
    path.write_text(path.read_text() + "\n".join(lines))
