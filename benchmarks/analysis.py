"""Derived figures: KV utilization (pagedserve steps vs static batches), step-time shares, targets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.arm_hf import Batch


@dataclass(slots=True)
class Series:
    t: list[float]  # fraction of the run, 0..1
    util: list[float]


def paged_utilization(steps: list[dict[str, float]]) -> tuple[float | None, Series]:
    """live tokens / allocated slots per step; steady state = mean over the middle 80% of the run."""
    rows = [r for r in steps if r["allocated_slots"] > 0]
    if not rows:
        return None, Series([], [])
    t0, t1 = rows[0]["t"], rows[-1]["t"]
    span = max(t1 - t0, 1e-9)
    series = Series([(r["t"] - t0) / span for r in rows], [r["live_tokens"] / r["allocated_slots"] for r in rows])
    mid = [u for t, u in zip(series.t, series.util) if 0.1 <= t <= 0.9] or series.util
    return float(np.mean(mid)), series


def static_utilization(batches: list[Batch], times: list[tuple[float, float]]) -> tuple[float | None, Series]:
    """Live tokens / reserved slots while static batches decode.

    A batch reserves rows of (longest prompt + longest output); at decode step g
    row i really holds prompt_i + min(g, output_i) tokens: padding and tokens a
    finished row keeps "generating" are waste.
    """
    live_sum = reserved_sum = 0
    ts: list[float] = []
    us: list[float] = []
    if not batches:
        return None, Series([], [])
    start, stop = times[0][0], times[-1][1]
    span = max(stop - start, 1e-9)
    for batch, (b0, b1) in zip(batches, times):
        g_max = batch.steps
        for g in range(1, g_max + 1):
            live = sum(len(r.prompt_ids) + min(g, r.output_len) for r in batch.requests)
            live_sum += live
            reserved_sum += batch.reserved_tokens
            ts.append((b0 + (b1 - b0) * g / g_max - start) / span)
            us.append(live / batch.reserved_tokens)
    return live_sum / reserved_sum, Series(ts, us)


def overhead_share(steps: list[dict[str, float]]) -> float | None:
    """Share of the executor's time spent waiting for the loop between steps (``idle_ms``, which the
    executor measures: right for the pipelined loop, whose own time overlaps the steps); for step logs
    without it, the share of step time outside the forward pass (scheduling, Redis, gRPC, plan handling)."""
    if steps and all("idle_ms" in r for r in steps):
        idle, busy = sum(r["idle_ms"] for r in steps[1:]), sum(r["step_ms"] for r in steps[1:])
        return idle / (idle + busy) if idle + busy > 0 else None
    total = sum(r["schedule_ms"] + r["redis_ms"] + r["executor_ms"] for r in steps)
    forward = sum(r["forward_ms"] for r in steps)
    return (total - forward) / total if total > 0 else None


@dataclass(slots=True)
class Target:
    name: str
    goal: str
    value: float | None
    threshold: float
    higher_is_better: bool
    unit: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.threshold if self.higher_is_better else self.value <= self.threshold

    def verdict(self) -> str:
        if self.value is None:
            return "not measured"
        if self.met:
            return "met"
        if self.higher_is_better:
            short = f"{self.threshold - self.value:.3g}{self.unit}"
            return f"missed: {self.value / self.threshold:.0%} of the goal ({short} short)"
        return (
            f"missed: {self.value / self.threshold:.1f}x the limit ({self.value - self.threshold:.3g}{self.unit} over)"
        )

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "goal": self.goal, "value": self.value, "met": self.met, "verdict": self.verdict()}
