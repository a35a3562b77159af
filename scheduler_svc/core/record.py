"""What one step changed: the pure core's account of itself, for the store to persist.

The scheduler fills a ``StepRecord`` as things happen (intake, scheduling,
the executor's result, requeues) and hands it over with ``take_record``;
``scheduler_svc.state.codec`` turns it into Redis operations and the frontends'
event. Nothing here knows about Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from scheduler_svc.core.logprob import Logprob
from scheduler_svc.core.request import Request

if TYPE_CHECKING:
    from scheduler_svc.core.migration import Ask, KvSource, Lent, Offer


@dataclass(slots=True)
class Counters:
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    disk_spilled_blocks: int = 0
    steps: int = 0
    generated_tokens: int = 0
    finished: int = 0  # requests that ended here (the finish rate behind admission's retry hint)
    prefix_cache_queries: int = 0  # tokens of requests admitted holding nothing, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which: tokens found cached (not computed again)
    forked_tokens: int = 0  # prompt tokens a parallel-sampling group mate took from its source (not computed again)
    spec_drafts: int = 0  # rows that ran drafts (speculative decoding; vLLM's spec_decode_num_drafts)
    spec_draft_tokens: int = 0  # drafted tokens run
    spec_accepted_tokens: int = 0  # of which accepted
    migrations_out: int = 0  # requests that left this executor with their KV lent (core/migration.py)
    migrations_in: int = 0  # requests whose KV this executor pulled from a peer
    migrations_failed: int = 0  # pulls that failed: those requests recompute
    migrated_blocks: int = 0  # blocks pulled
    migrated_bytes: int = 0
    moved_recomputed_tokens: int = 0  # computed tokens whose KV requests lost by leaving (requeue, failed pull)
    migrations_drain: int = 0  # migrations_out by cause: the executor drains,
    migrations_rebalance: int = 0  # its KV usage was over a peer's by --rebalance-gap,
    migrations_preempt: int = 0  # or it would have preempted (core/rebalance.py),
    migrations_disagg: int = 0  # or a prefill executor handed it to a decode executor (core/disagg.py)
    precopies: int = 0  # moves whose full blocks were lent to their destination while they kept running
    peer_prefix_asks: int = 0  # requests that waited for a peer's cached prefix instead of computing it
    peer_prefix_timeouts: int = 0  # ... and computed it after all: no offer came in time
    fetched_blocks: int = 0  # blocks pulled here ahead of their request (core/prefetch.py)
    fetches_failed: int = 0
    precopy_blocks: int = 0  # of fetched_blocks: pre-copies of moving requests
    prefix_blocks: int = 0  # of fetched_blocks: peer prefix hits
    handoff_blocks: int = 0  # of fetched_blocks: prompts a prefill executor computed for this one (core/disagg.py)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def nonzero(self) -> dict[str, int]:
        return {k: v for k, v in self.as_dict().items() if v}


@dataclass(slots=True)
class CacheDelta:
    """What a step changed in the prefix cache (``BlockManager.cache_delta``)."""

    hashed: dict[int, str] = field(default_factory=dict)  # device block -> hex hash, for blocks cached now
    unhashed: list[int] = field(default_factory=list)  # changed blocks that hold no hash now
    evictable: dict[int, int] = field(default_factory=dict)  # cached blocks nobody holds -> LRU rank
    held: list[int] = field(default_factory=list)  # changed blocks that are not evictable now
    added: list[str] = field(default_factory=list)  # hex hashes cached now on this executor
    dropped: list[str] = field(default_factory=list)  # hex hashes no longer cached here

    def __bool__(self) -> bool:
        return bool(self.hashed or self.unhashed or self.evictable or self.held or self.added or self.dropped)


@dataclass(slots=True)
class StepRecord:
    """Everything a step changed. ``changed`` is filled by ``Scheduler.take_record``."""

    touched: dict[str, Request] = field(default_factory=dict)  # status, blocks or num_computed changed
    new_tokens: dict[str, list[int]] = field(default_factory=dict)  # appended to output_ids this step
    # With logprobs: one entry per token of new_tokens.
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)  # prompt position -> entry
    finished: list[Request] = field(default_factory=list)
    requeued: list[Request] = field(default_factory=list)  # back to the shared queue, holding nothing
    counters: Counters = field(default_factory=Counters)  # deltas
    changed: tuple[set[int], set[int], set[int]] = field(default_factory=lambda: (set(), set(), set()))
    cache: CacheDelta = field(default_factory=CacheDelta)  # filled by ``Scheduler.take_record`` too
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # drafts accepted at draft position 0, 1...
    # KV migration (core/migration.py): lends made and ended here; pulls done (ok or not: their sources'
    # lends can end) with their time and bytes; moved requests' departures, at their first token here.
    lent: list[Lent] = field(default_factory=list)
    unlent: list[str] = field(default_factory=list)
    pulled: list[tuple[Request, KvSource]] = field(default_factory=list)
    pull_ms: list[tuple[bool, float, int]] = field(default_factory=list)  # (ok, ms, bytes)
    stalls: list[int] = field(default_factory=list)  # moved_at_ms
    # KV that moves ahead of a request: offers to readers (their lends registered), asks to holders, and
    # lends of peers whose reading ended here (a fetch reported, or refused): their loops end them.
    offers: list[Offer] = field(default_factory=list)
    asks: list[Ask] = field(default_factory=list)
    rung: list[str] = field(default_factory=list)
    fetched: list[tuple[str, bool, float, int]] = field(default_factory=list)  # (cause, ok, ms, blocks) per fetch

    def touch(self, req: Request) -> None:
        self.touched[req.request_id] = req

    @property
    def empty(self) -> bool:
        return not (
            self.touched
            or self.new_tokens
            or self.finished
            or self.requeued
            or self.lent
            or self.unlent
            or self.pulled
            or self.offers
            or self.asks
            or self.rung
            or any(self.changed)
            or self.cache
            or self.counters.nonzero()
        )
