"""Speculative decoding: output tokens/s with drafts against without, on requests that quote their prompts.

Three deployments of the same model side by side (``benchmarks.stack``: Redis, one executor, one scheduler
each), identical but for the scheduler's ``--speculative-config``: ``off``, ``ngram`` (prompt lookup) and
``suffix`` (SuffixDecoding). Each holds its own KV pool and prefix cache, so no mode reuses another's
prompts; an idle one waits on its doorbell and costs nothing while another runs. The workload is
``spec_tasks``: chat requests that hand the model a passage or a function and ask for it back rewritten,
summarised or edited, greedy, at most ``max_tokens`` each (they end at EOS otherwise).

- **batch 1**: ``requests`` tasks one at a time; each task runs on every deployment before the next task
  (the order of the modes rotates), so the modes share the machine's drift. Output tokens/s of a mode =
  its tokens / the sum of its requests' times (submission to the last token).
- **batch N**: ``rounds`` x ``batch`` other tasks: each round's batch is sent at once to every deployment in
  turn (the order rotating between rounds); tokens / the sum of the batches' wall times.

Every task is used once per mode (the suffix proposer keeps finished requests' outputs: a task asked twice
would draft from its own earlier answer). Per phase and mode the arm also reads the namespace counters
(drafts, draft tokens, accepted tokens) and the loop's step log (the executor's step time, its wait for
the loop, tokens per step), which say where a speedup or a loss comes from. Speedups are
``spec tokens/s / off tokens/s`` in the same phase; greedy output is the same with or without drafts (up
to argmax near-ties, counted in ``tokens_identical``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import psutil
import redis

from benchmarks import cpu
from benchmarks.spec_tasks import Task, provenance, tasks
from benchmarks.stack import Stack, StackConfig, start
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

NAMESPACE = "spec"
MODES = ("off", "ngram", "suffix")
COUNTERS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "steps", "generated_tokens")


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    requests: int = 8  # the batch-1 phase: tasks one at a time
    batch: int = 32  # the concurrent phase: this many other tasks at once
    rounds: int = 2  # batches of the concurrent phase per mode (fresh tasks each, the modes' order rotating)
    max_tokens: int = 160
    num_speculative_tokens: int = 5  # ngram's k (suffix: vLLM's default, the tree depth, capped by the match)
    kv_cache_bytes: int = 768 << 20  # per deployment: the whole batch without preemption
    seed: int = 0

    def spec_config(self, mode: str) -> dict[str, object] | None:
        """vLLM's documented examples: ngram with 5 drafts after a 4-token match, suffix with its defaults."""
        if mode == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens, "prompt_lookup_max": 4}
        if mode == "suffix":
            return {"method": "suffix"}
        return None


@dataclass(slots=True)
class PhaseResult:
    """One mode in one phase."""

    tokens: int
    seconds: float  # batch 1: the sum of request times; batch N: the sum of the batches' wall times
    counters: dict[str, int]  # namespace counter deltas
    steps: dict[str, float | None]  # from the step log: step_ms / idle_ms p50, tokens per step
    outputs: list[list[int]] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)  # batch N: tokens/s of each batch

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """vLLM's draft acceptance rate: accepted / drafted tokens."""
        drafted = self.counters.get("spec_draft_tokens", 0)
        return self.counters.get("spec_accepted_tokens", 0) / drafted if drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's: tokens a drafting row yields per step, 1 + accepted / drafts."""
        rows = self.counters.get("spec_drafts", 0)
        return 1 + self.counters.get("spec_accepted_tokens", 0) / rows if rows else None

    def as_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "output_tokens_per_s": round(self.tokens_per_s, 2),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "counters": self.counters,
            "steps": self.steps,
            "rounds_tokens_per_s": self.rounds,
        }


@dataclass(slots=True)
class SpecBenchResult:
    config: SpecBenchConfig
    phases: dict[str, dict[str, PhaseResult]] = field(default_factory=dict)  # "batch1"/"batchN" -> mode -> result
    load: dict[str, list[float]] = field(default_factory=dict)  # os.getloadavg(): before the arm, each phase, after
    # Per phase: CPU cores busy with anything but this arm's processes (the machine's busy time minus the arm's own
    # CPU time, over the phase's wall time): the load the figures were measured under, which a load average that
    # counts the arm itself does not say.
    others_cores: dict[str, float] = field(default_factory=dict)
    # Per phase: the shares of speculation off's output tokens whose 4-gram occurs in the prompt (quoted), only
    # earlier in the output (repeated), or nowhere before (``spec_tasks.provenance``).
    provenance: dict[str, dict[str, float]] = field(default_factory=dict)
    python: str = sys.version.split()[0]

    def speedup(self, phase: str, mode: str) -> float | None:
        got = self.phases.get(phase, {})
        off, on = got.get("off"), got.get(mode)
        return on.tokens_per_s / off.tokens_per_s if off and on and off.tokens_per_s else None

    def identical(self, phase: str, mode: str) -> float | None:
        """The fraction of the phase's requests whose tokens equal speculation off's."""
        got = self.phases.get(phase, {})
        off, on = got.get("off"), got.get(mode)
        if not off or not on or not off.outputs:
            return None
        return sum(a == b for a, b in zip(off.outputs, on.outputs)) / len(off.outputs)

    @staticmethod
    def empty_keys() -> dict[str, object]:
        """The keys when the arm did not run (null, never faked)."""
        return {
            "spec_speedup_batch1": None,
            "spec_speedup_batch32": None,
            "spec_acceptance_rate": None,
            "spec_speedup_batch1_by_method": None,
            "spec_speedup_batch32_by_method": None,
        }

    def keys(self) -> dict[str, object]:
        """``summary.json``'s keys: the better proposer's batch-1 speedup, the batch-N speedup of the
        proposer that gains least there (no proposer may lose), and per proposer each speedup and its
        acceptance rate (over both phases)."""
        acc: dict[str, float | None] = {}
        for m in MODES[1:]:
            drafted = sum(p[m].counters.get("spec_draft_tokens", 0) for p in self.phases.values() if m in p)
            accepted = sum(p[m].counters.get("spec_accepted_tokens", 0) for p in self.phases.values() if m in p)
            acc[m] = accepted / drafted if drafted else None
        return {
            "spec_speedup_batch1": self.best_batch1(),
            "spec_speedup_batch32": self.least_batch_n(),
            "spec_acceptance_rate": acc,
            "spec_speedup_batch1_by_method": {m: self.speedup("batch1", m) for m in MODES[1:]},
            "spec_speedup_batch32_by_method": {m: self.speedup("batchN", m) for m in MODES[1:]},
        }

    def best_batch1(self) -> float | None:
        """The better proposer's batch-1 speedup."""
        got = [v for m in MODES[1:] if (v := self.speedup("batch1", m)) is not None]
        return max(got) if got else None

    def least_batch_n(self) -> float | None:
        """The batch-N speedup of the proposer that gains least (None unless both were measured)."""
        got = [v for m in MODES[1:] if (v := self.speedup("batchN", m)) is not None]
        return min(got) if len(got) == len(MODES) - 1 else None

    def as_dict(self) -> dict[str, object]:
        return {
            "config": asdict(self.config),
            "spec_configs": {m: self.config.spec_config(m) for m in MODES},
            "python": self.python,
            "load_avg": self.load,
            "others_cores": self.others_cores,
            "output_provenance": self.provenance,
            "phases": {ph: {m: r.as_dict() for m, r in got.items()} for ph, got in self.phases.items()},
            "tokens_identical": {
                ph: {m: self.identical(ph, m) for m in MODES[1:]} for ph in self.phases if "off" in self.phases[ph]
            },
        }


def stack_config(cfg: SpecBenchConfig, mode: str, logs: Path) -> StackConfig:
    spec = cfg.spec_config(mode)
    args = ("--speculative-config", json.dumps(spec)) if spec else ()
    return StackConfig(cfg.kv_cache_bytes, scheduler_args=args, namespace=NAMESPACE, step_log=logs / "steps.jsonl")


def request(task: Task, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=task.prompt)],
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def _one(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> tuple[list[int], float]:
    t = time.perf_counter()
    tokens: list[int] = []
    async for resp in stub.Generate(req, timeout=1800):
        tokens += resp.token_ids
    return tokens, time.perf_counter() - t


async def _batch(address: str, reqs: list[pb.GenerateRequest]) -> tuple[list[list[int]], float]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t = time.perf_counter()
        done = await asyncio.gather(*(_one(stub, r) for r in reqs))
        return [toks for toks, _ in done], time.perf_counter() - t


def _counters(client: redis.Redis) -> dict[str, int]:
    raw = client.hgetall(Keys(NAMESPACE).counters)
    return {k: int(raw.get(k, 0)) for k in COUNTERS}


def _steps(log: Path, windows: list[tuple[float, float]]) -> dict[str, float | None]:
    """The step log's lines written within the wall-time ``windows``: the executor's step and its wait for
    the loop (p50, ms), and tokens scheduled per step."""
    rows = []
    if log.exists():
        for line in log.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if any(t0 <= r["t"] <= t1 for t0, t1 in windows):
                    rows.append(r)

    def p50(key: str) -> float | None:
        return round(statistics.median(r[key] for r in rows), 3) if rows else None

    return {
        "steps": len(rows),
        "step_ms_p50": p50("step_ms"),
        "idle_ms_p50": p50("idle_ms"),
        "scheduled_tokens_mean": round(statistics.fmean(r["scheduled_tokens"] for r in rows), 2) if rows else None,
        "running_mean": round(statistics.fmean(r["running"] for r in rows), 2) if rows else None,
    }


@dataclass(slots=True)
class _Tally:
    """One mode's figures in one phase, as its requests or batches come in."""

    tokens: int = 0
    seconds: float = 0.0
    counters: dict[str, int] = field(default_factory=lambda: {k: 0 for k in COUNTERS})
    windows: list[tuple[float, float]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)  # tokens/s per batch (batch N)

    def add(self, outs: list[list[int]], seconds: float, before: dict[str, int], after: dict[str, int]) -> None:
        self.tokens += sum(len(o) for o in outs)
        self.seconds += seconds
        for k in COUNTERS:
            self.counters[k] += after[k] - before[k]
        self.outputs += outs

    def result(self, log: Path) -> PhaseResult:
        steps = _steps(log, self.windows)
        return PhaseResult(self.tokens, self.seconds, self.counters, steps, self.outputs, self.rounds)


@dataclass(slots=True)
class _Deployment:
    mode: str
    stack: Stack
    client: redis.Redis
    step_log: Path


def _start(model_dir: Path, cfg: SpecBenchConfig, log_dir: Path) -> dict[str, _Deployment]:
    def one(mode: str) -> _Deployment:
        scfg = stack_config(cfg, mode, log_dir / mode)
        dep = start(model_dir, scfg, log_dir / mode)
        assert scfg.step_log is not None
        return _Deployment(mode, dep, redis.Redis.from_url(dep.redis.url, decode_responses=True), scfg.step_log)

    with ThreadPoolExecutor(len(MODES)) as pool:
        futures = {m: pool.submit(one, m) for m in MODES}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    if failed:
        for f in futures.values():
            if f.exception() is None:
                f.result().stack.stop()
        raise failed[0]  # type: ignore[misc]
    return {m: f.result() for m, f in futures.items()}


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass(slots=True)
class _Others:
    """CPU seconds the machine spent on other processes than the arm's (its deployments and this one)."""

    meter: cpu.Meter
    t0: float = 0.0
    busy0: float = 0.0
    ours0: float = 0.0

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))

    def begin(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), sum(self.meter.snapshot().values())

    def cores(self) -> float:
        """Cores busy with other processes since ``begin``, on average."""
        others = (self._busy() - self.busy0) - (sum(self.meter.snapshot().values()) - self.ours0)
        return round(max(0.0, others) / max(1e-9, time.monotonic() - self.t0), 2)


def _provenance(model_dir: Path, asked: list[Task], outputs: list[list[int]]) -> dict[str, float]:
    """``spec_tasks.provenance`` over the outputs, as shares of their tokens; prompts as the frontend makes them
    (the model's chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    total = {"quoted": 0, "repeated": 0, "new": 0}
    for task, output in zip(asked, outputs):
        chat = [{"role": "user", "content": task.prompt}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        for k, v in provenance(tok(text, add_special_tokens=False)["input_ids"], output).items():
            total[k] += v
    n = max(1, sum(total.values()))
    return {k: round(v / n, 3) for k, v in total.items()}


def _rotated(i: int) -> tuple[str, ...]:
    return MODES[i % len(MODES) :] + MODES[: i % len(MODES)]


def run(model_dir: Path, cfg: SpecBenchConfig, log_dir: Path) -> SpecBenchResult:
    n1, nb = cfg.requests, cfg.batch
    work = tasks(n1 + cfg.rounds * nb + 1, cfg.seed)
    warm, solo = work[-1], work[:n1]
    out = SpecBenchResult(cfg)
    out.load["before"] = _loadavg()
    deps = _start(model_dir, cfg, log_dir)
    roots = [p.pid for d in deps.values() for p in (d.stack.redis.proc, *(x.proc for x in d.stack.services))]
    others = _Others(cpu.Meter(roots, cpu.pagedserve_role))

    def send(mode: str, batch: list[Task], tally: _Tally) -> None:
        d = deps[mode]
        before, t0 = _counters(d.client), time.time()
        outs, seconds = asyncio.run(_batch(d.stack.address, [request(t, cfg.max_tokens) for t in batch]))
        tally.windows.append((t0, time.time()))
        tally.add(outs, seconds, before, _counters(d.client))
        if len(batch) > 1:
            tally.rounds.append(round(sum(len(o) for o in outs) / seconds, 2))

    try:
        for d in deps.values():  # the first forward pays one-off costs
            asyncio.run(_batch(d.stack.address, [request(warm, 8)]))
        # batch 1: each task on every deployment before the next task, the modes' order rotating
        out.load["batch1"] = _loadavg()
        others.begin()
        solo_tally = {m: _Tally() for m in MODES}
        for i, task in enumerate(solo):
            for mode in _rotated(i):
                send(mode, [task], solo_tally[mode])
        out.others_cores["batch1"] = others.cores()
        out.phases["batch1"] = {m: solo_tally[m].result(deps[m].step_log) for m in MODES}
        out.provenance["batch1"] = _provenance(model_dir, solo, solo_tally["off"].outputs)
        # batch N: rounds of fresh tasks sent at once, each round on every deployment, the order rotating
        out.load["batchN"] = _loadavg()
        others.begin()
        many_tally = {m: _Tally() for m in MODES}
        for r in range(cfg.rounds):
            batch = work[n1 + r * nb : n1 + (r + 1) * nb]
            for mode in _rotated(r):
                send(mode, batch, many_tally[mode])
        out.others_cores["batchN"] = others.cores()
        out.phases["batchN"] = {m: many_tally[m].result(deps[m].step_log) for m in MODES}
        together = [t for r in range(cfg.rounds) for t in work[n1 + r * nb : n1 + (r + 1) * nb]]
        out.provenance["batchN"] = _provenance(model_dir, together, many_tally["off"].outputs)
        out.load["after"] = _loadavg()
    finally:
        for d in deps.values():
            d.client.close()
        with ThreadPoolExecutor(len(deps)) as pool:
            list(pool.map(lambda d: d.stack.stop(), deps.values()))
    return out


def section(summary: dict) -> list[str]:
    """report.md's section, from ``summary.json``'s keys."""
    s = summary.get("spec_decode")
    lines = ["", "## Speculative decoding (n-gram and suffix drafts)", ""]
    if not s:
        return [*lines, "Not run.", ""]
    c, load = s["config"], s["load_avg"]
    one_min = ", ".join(f"{k} {v[0]:.2f}" for k, v in load.items())
    others = ", ".join(f"{k} {v:.2f}" for k, v in s.get("others_cores", {}).items())
    prov = "; ".join(
        f"{ph}: quoted from the prompt {p['quoted']:.0%}, repeating earlier output only {p['repeated']:.0%}, "
        f"new {p['new']:.0%}"
        for ph, p in s.get("output_provenance", {}).items()
    )
    lines += [
        f"{c['requests']} tasks one at a time, then {c['rounds']} rounds of {c['batch']} others at once, greedy, at "
        f"most {c['max_tokens']} tokens each: chat requests quoting a passage or a function (Python {s['python']}'s "
        f"standard library); one deployment per mode. 1-minute load average (this arm's own processes included) "
        f"at: {one_min}; CPU cores busy with other processes, on average: {others}.",
        "",
        f"Where the output comes from (speculation off's tokens, each with the 3 before it): {prov}. Drafts predict "
        "the first two; the second is the model's own loops.",
        "",
        "| phase | mode | output tok/s | speedup | acceptance | mean accepted length | step p50 ms | executor "
        "wait p50 ms | tokens / step | identical to off |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ph, got in s["phases"].items():
        off = got.get("off", {}).get("output_tokens_per_s")
        for m, r in got.items():
            sp = r["output_tokens_per_s"] / off if off else None
            ident = s["tokens_identical"].get(ph, {}).get(m) if m != "off" else None
            st = r["steps"]
            lines.append(
                f"| {ph} | {m} | {r['output_tokens_per_s']:.1f} | {_f(sp, 2)} | {_f(r['acceptance_rate'], 3)} | "
                f"{_f(r['mean_acceptance_length'], 2)} | {_f(st['step_ms_p50'], 1)} | {_f(st['idle_ms_p50'], 1)} | "
                f"{_f(st['scheduled_tokens_mean'], 1)} | {_f(ident, 2)} |"
            )
    return [*lines, ""]


def _f(x: object, nd: int) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def main() -> None:
    import argparse

    from executor_svc.model_store import resolve_model

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--logs", default="/tmp/pagedserve-spec")
    a = p.parse_args()
    cfg = SpecBenchConfig(a.requests, a.batch, a.rounds, a.max_tokens, a.num_speculative_tokens)
    r = run(resolve_model(a.model), cfg, Path(a.logs))
    print(json.dumps({**r.keys(), "spec_decode": r.as_dict()}, indent=1))


if __name__ == "__main__":
    main()
