"""The executor's Prometheus metrics: what its steps cost, and its pools (``docs/metrics.md``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from executor_svc.plan import StepOutput
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.metrics import LATENCY_BUCKETS, name
from pagedserve.tiers import Tier


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        m = ["model_name"]
        self.forward = Histogram(
            name("executor_forward_seconds"),
            "Packed forward pass and sampling of a step",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.step = Histogram(
            name("executor_step_seconds"),
            "A whole step: checks, swaps, forward, sampling",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.swap = Histogram(
            name("executor_swap_seconds"),
            "Block copies of a step, by direction (host time)",
            [*m, "direction"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.steps = Counter(name("executor_steps"), "Steps executed", m, registry=registry)
        self.blocks = Gauge(
            name("executor_kv_blocks"), "KV blocks of this executor's pools, by tier", [*m, "tier"], registry=registry
        )

        self.pull = Histogram(
            name("executor_kv_pull_seconds"),
            "Reading one request's KV blocks from a peer executor (migration), by outcome",
            [*m, "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.pull_bytes = Counter(
            name("executor_kv_pulled_bytes"), "KV bytes read from peer executors", m, registry=registry
        )

    def pulled(self, results: Iterable[pb.PullResult]) -> None:
        for r in results:
            self.pull.labels(self.model, "ok" if r.ok else "failed").observe(r.ms / 1e3)
            self.pull_bytes.labels(self.model).inc(r.bytes)

    def pools(self, counts: dict[Tier, int]) -> None:
        for tier, n in counts.items():
            self.blocks.labels(self.model, tier.label).set(n)

    def observe(self, out: StepOutput, swapped_in: bool, swapped_out: bool) -> None:
        self.steps.labels(self.model).inc()
        self.step.labels(self.model).observe(out.step_ms / 1e3)
        if out.forward_ms:
            self.forward.labels(self.model).observe(out.forward_ms / 1e3)
        if swapped_in:
            self.swap.labels(self.model, "in").observe(out.swap_in_ms / 1e3)
        if swapped_out:
            self.swap.labels(self.model, "out").observe(out.swap_out_ms / 1e3)
