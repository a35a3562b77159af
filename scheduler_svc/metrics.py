"""The scheduler's Prometheus metrics (names as vLLM's, under ``pagedserve:``).

Who exports what, so that nothing is counted twice across replicas:
- ``LoopMetrics`` (loop process): per executor, by the replica that leads its
  loop — gauges of its pool and counters of what its committed steps did.
  When a lease moves, the old leader drops that executor's gauges; counters
  restart on the new leader, which ``rate()``/``increase()`` handle.
- ``NamespaceMetrics`` (loop process): the queue and the membership, exported
  only by the replica holding the namespace's metrics lease.
- ``FrontendMetrics`` (API process): latencies of the streams it serves.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.metrics import LATENCY_BUCKETS, name
from pagedserve.tiers import Tier
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.record import StepRecord
from scheduler_svc.core.request import Finish

TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _usage(view: PoolView, tier: Tier) -> float:
    total = view.blocks[tier]
    return 0.0 if total == 0 else 1 - view.free[tier] / total


class LoopMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        ex = ["model_name", "executor"]

        def gauge(metric: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name(metric), doc, [*ex, *labels], registry=registry)

        def counter(metric: str, doc: str, *labels: str) -> Counter:
            return Counter(name(metric), doc, [*ex, *labels], registry=registry)

        self.running = gauge("num_requests_running", "Requests running on the executor")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to the executor's CPU or disk tier")
        self.kv = gauge("kv_cache_usage_perc", "Fraction of the executor's device KV blocks in use (0-1)")
        self.cpu_swap = gauge("cpu_swap_usage_perc", "Fraction of the executor's CPU swap blocks in use (0-1)")
        self.disk_swap = gauge("disk_swap_usage_perc", "Fraction of the executor's disk swap blocks in use (0-1)")
        self.preemptions = counter("num_preemptions", "Requests preempted, by mode", "mode")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (committed steps)")
        self.success = counter("request_success", "Finished requests, by finish reason", "finished_reason")
        self.swapped_blocks = counter("swapped_blocks", "KV blocks moved between tiers", "direction", "tier")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.forked_tokens = counter(
            "parallel_sampling_shared_tokens",
            "Prompt tokens a completion of a sampling.n request shared instead of computing",
        )
        # Speculative decoding (--speculative-config), vLLM's names.
        self.spec_drafts = counter("spec_decode_num_drafts", "Rows of steps that ran drafted tokens")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens run")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by draft position", "position"
        )
        # KV that moves (core/migration.py, core/prefetch.py): requests that moved with their KV, by cause
        # (drain, rebalance, preempt), and blocks pulled ahead of a request, by cause (precopy, prefix).
        self.migrations = counter(
            "kv_migrations",
            "Requests that moved between executors with their KV, by cause and outcome",
            "cause",
            "outcome",
        )
        self.fetches = counter(
            "kv_fetches",
            "Blocks pulled from a peer ahead of their request (a move's pre-copy, a peer's cached prefix), by cause "
            "and outcome",
            "cause",
            "outcome",
        )
        self.fetched_blocks = counter("kv_fetched_blocks", "KV blocks pulled ahead of their request, by cause", "cause")
        self.peer_prefix_asks = counter(
            "kv_peer_prefix_asks", "Requests that waited for a peer's cached prefix instead of computing it", "outcome"
        )
        self.migrated_blocks = counter("kv_migrated_blocks", "KV blocks pulled from peer executors")
        self.migrated_bytes = counter("kv_migrated_bytes", "KV bytes pulled from peer executors")
        self.transfer_time = Histogram(
            name("kv_transfer_seconds"),
            "Pulling KV blocks from a peer (one request's, or one fetch's), by outcome",
            [*ex, "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.migration_stall = Histogram(
            name("kv_migration_stall_seconds"),
            "From a request leaving its source executor to its next token on the destination",
            ex,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.iteration_tokens = Histogram(
            name("iteration_tokens_total"), "Tokens scheduled per step", ex, buckets=TOKEN_BUCKETS, registry=registry
        )
        self.queue_time = Histogram(
            name("request_queue_time_seconds"),
            "From submission to first admission on an executor",
            ex,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # Prefill and decode executors (--role, core/disagg.py): an info series to join other series by role
        # (prefill scales on prompt tokens, decode on running sequences and KV usage), and the prompt tokens
        # its requests have still to compute.
        self.role_info = gauge("executor_role_info", "1 for each executor led here, labelled with its --role", "role")
        self.prompt_pending = gauge(
            "num_prompt_tokens_pending", "Prompt tokens the executor's placed requests have still to compute"
        )
        self._roles: dict[tuple[str, str], str] = {}
        self._gauges = (self.running, self.swapped, self.kv, self.cpu_swap, self.disk_swap, self.prompt_pending)
        # vLLM's lora_requests_info (what the Gateway API inference extension routes by): one series per
        # executor whose labels are its adapters; its value the time they were last seen (--enable-lora only).
        self.lora_info = Gauge(
            name("lora_requests_info"),
            "LoRA adapters of the executor's running and waiting requests (labels, comma-separated)",
            [*ex, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=registry,
        )
        self._lora_labels: dict[tuple[str, str], tuple[str, ...]] = {}

    def lead(self, model: str, executor: str) -> None:
        """A loop starts: its counters exist (at 0) from now on, as vLLM's do."""
        labels = (model, executor)
        for c in (
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.forked_tokens,
        ):
            c.labels(*labels)
        for mode in ("swap", "recompute"):
            self.preemptions.labels(*labels, mode)

    def pool(self, model: str, executor: str, view: PoolView, prompt_pending: int = 0) -> None:
        labels = (model, executor)
        if self._roles.get(labels) != view.role:
            if (old := self._roles.pop(labels, None)) is not None:
                self.role_info.remove(*labels, old)
            self._roles[labels] = view.role
            self.role_info.labels(*labels, view.role).set(1)
        self.prompt_pending.labels(*labels).set(prompt_pending)
        self.running.labels(*labels).set(view.running)
        self.swapped.labels(*labels).set(view.swapped)
        self.kv.labels(*labels).set(_usage(view, Tier.DEVICE))
        self.cpu_swap.labels(*labels).set(_usage(view, Tier.CPU))
        self.disk_swap.labels(*labels).set(_usage(view, Tier.DISK))

    def loras(self, model: str, executor: str, max_lora: int, running: list[str], waiting: list[str]) -> None:
        labels = (model, executor, str(max_lora), ",".join(sorted(set(running))), ",".join(sorted(set(waiting))))
        old = self._lora_labels.get((model, executor))
        if old is not None and old != labels:
            self.lora_info.remove(*old)
        self._lora_labels[(model, executor)] = labels
        self.lora_info.labels(*labels).set(time.time())

    def step(self, model: str, executor: str, scheduled_tokens: int) -> None:
        self.iteration_tokens.labels(model, executor).observe(scheduled_tokens)

    def admitted(self, model: str, executor: str, submitted_ms: int) -> None:
        """A request runs for the first time: how long it waited since its submission."""
        self.queue_time.labels(model, executor).observe(max(0.0, time.time() - submitted_ms / 1000))

    def committed(self, model: str, executor: str, rec: StepRecord) -> None:
        """What a step that landed in Redis did."""
        labels = (model, executor)
        c = rec.counters
        self.generation_tokens.labels(*labels).inc(sum(len(t) for t in rec.new_tokens.values()))
        for mode, n in (("swap", c.preemptions_swap), ("recompute", c.preemptions_recompute)):
            if n:
                self.preemptions.labels(*labels, mode).inc(n)
        for direction, tier, n in (
            ("out", "cpu", c.swapped_out_blocks - c.disk_spilled_blocks),
            ("out", "disk", c.disk_spilled_blocks),
            ("in", "any", c.swapped_in_blocks),
        ):
            if n:
                self.swapped_blocks.labels(*labels, direction, tier).inc(n)
        if c.prefix_cache_queries:
            self.prefix_queries.labels(*labels).inc(c.prefix_cache_queries)
            self.prefix_hits.labels(*labels).inc(c.prefix_cache_hits)
        if c.forked_tokens:
            self.forked_tokens.labels(*labels).inc(c.forked_tokens)
        if c.spec_drafts:
            self.spec_drafts.labels(*labels).inc(c.spec_drafts)
            self.spec_draft_tokens.labels(*labels).inc(c.spec_draft_tokens)
            self.spec_accepted_tokens.labels(*labels).inc(c.spec_accepted_tokens)
            for pos, n in enumerate(rec.spec_accepted_per_pos):
                self.spec_accepted_per_pos.labels(*labels, str(pos)).inc(n)
        self._moved(labels, rec)
        for req in rec.finished:
            self.prompt_tokens.labels(*labels).inc(len(req.prompt_ids))
            self.success.labels(*labels, (req.finish_reason or Finish.ABORT).value).inc()

    def _moved(self, labels: tuple[str, str], rec: StepRecord) -> None:
        c = rec.counters
        if c.migrated_blocks or c.fetched_blocks:
            self.migrated_blocks.labels(*labels).inc(c.migrated_blocks + c.fetched_blocks)
        if c.migrated_bytes:
            self.migrated_bytes.labels(*labels).inc(c.migrated_bytes)
        for (_, src), (ok, ms, _) in zip(rec.pulled, rec.pull_ms, strict=True):
            outcome = "ok" if ok else "recomputed"
            self.migrations.labels(*labels, src.cause, outcome).inc()
            self.transfer_time.labels(*labels, outcome).observe(ms / 1e3)
        for cause, ok, ms, blocks in rec.fetched:
            outcome = "ok" if ok else "failed"
            self.fetches.labels(*labels, cause, outcome).inc()
            self.transfer_time.labels(*labels, outcome).observe(ms / 1e3)
            if ok:
                self.fetched_blocks.labels(*labels, cause).inc(blocks)
        if c.peer_prefix_asks:
            self.peer_prefix_asks.labels(*labels, "asked").inc(c.peer_prefix_asks)
        if c.peer_prefix_timeouts:
            self.peer_prefix_asks.labels(*labels, "timed_out").inc(c.peer_prefix_timeouts)
        now = time.time()
        for at_ms in rec.stalls:
            self.migration_stall.labels(*labels).observe(max(0.0, now - at_ms / 1000))

    def forget(self, model: str, executor: str) -> None:
        """The lease went elsewhere: its new leader exports these gauges now."""
        for g in self._gauges:
            try:
                g.remove(model, executor)
            except KeyError:
                pass
        if (old := self._lora_labels.pop((model, executor), None)) is not None:
            self.lora_info.remove(*old)
        if (role := self._roles.pop((model, executor), None)) is not None:
            self.role_info.remove(model, executor, role)


class NamespaceMetrics:
    """Exported by the one replica that holds the namespace's metrics lease."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.waiting = Gauge(
            name("num_requests_waiting"), "Requests in the shared queue", ["model_name"], registry=registry
        )
        self.executors = Gauge(
            name("num_executors"), "Registered executors, by state", ["model_name", "state"], registry=registry
        )
        self.replicas = Gauge(
            name("num_scheduler_replicas"),
            "Scheduler replicas with a live heartbeat",
            ["model_name"],
            registry=registry,
        )
        self._model: str | None = None

    def set(self, model: str, waiting: int, executors: dict[str, int], replicas: int) -> None:
        if model != self._model:  # the namespace's model became known (or changed): no series under the old one
            self.clear()
            self._model = model
        self.waiting.labels(model).set(waiting)
        for state in ("serving", "draining"):
            self.executors.labels(model, state).set(executors.get(state, 0))
        self.replicas.labels(model).set(replicas)

    def clear(self) -> None:
        for g in (self.waiting, self.executors, self.replicas):
            g.clear()
        self._model = None


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = ["model_name"]
        self.ttft = Histogram(
            name("time_to_first_token_seconds"),
            "From submission to the first token streamed",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            name("inter_token_latency_seconds"),
            "Between two streamed messages of a request",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            name("e2e_request_latency_seconds"),
            "From submission to the last message",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.streams = Gauge(name("num_streams"), "Streams open on this replica", m, registry=registry)
