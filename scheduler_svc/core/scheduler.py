"""Continuous batching under a token budget, with preemption by swap or recompute.

One ``schedule()`` call decides a step; ``update()`` applies what the executor
returned. Like vLLM v1 there are no prefill/decode phases: every request gets
``min(pending tokens, remaining budget)`` tokens, so long prompts are chunked
across steps while running requests keep decoding.

Order within a step:
1. running requests, in policy order; a request that needs a block when none
   is free preempts the least urgent running request (possibly itself), unless
   swaps in this plan or requests that end with their tokens in flight (the
   pipelined loop) free enough by the next step: then it waits that step;
2. swapped requests come back, then waiting requests are admitted, both in
   policy order with swapped ones first among equals; admission keeps a
   watermark of free blocks back. Nothing is admitted in a step that had to
   preempt for a running request (that would only thrash). A waiting request
   holding nothing first takes its longest cached prefix (``BlockManager.lookup``)
   and computes only the rest: its ``num_computed`` starts at the hit.
3. under ``priority``, a waiting request that does not fit preempts running
   requests that are less urgent than it.

A parallel-sampling group (``SamplingParams.n``: mates with one prompt) is
admitted, preempted and resumed together. One mate computes the prompt; the
others wait, holding nothing, until it has launched the whole prompt, then fork
(``BlockManager.fork``): they share its full blocks and copy the partial one,
and compute only the last prompt token onward, each sampling its own
completion. A preempted group is always recomputed (swapping would store its
shared prompt once per mate), and forks again when it comes back. Which mates
move together, and what a fork costs, is ``core/group.py``.

With several executors, each has its own ``Scheduler``: running and swapped
requests are local, and waiting holds the requests its loop claimed from the
shared queue for this step. Whatever is still waiting after a step (not
admitted, or preempted for recompute) goes back to the shared queue
(``requeue_waiting``), so any executor can take it next.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from scheduler_svc.core import group, lora, prefix
from scheduler_svc.core.blocks import (
    DEVICE,
    DISK,
    TIERS,
    BlockManager,
)
from scheduler_svc.core.costs import Costs
from scheduler_svc.core.deadline import expired_among
from scheduler_svc.core.fit import blocks_for, fits_ever
from scheduler_svc.core.logprob import Logprob
from scheduler_svc.core.migration import (
    LEND_TTL_MS,
    OFFER_TTL_MS,
    Ask,
    KvSource,
    Lending,
    Lent,
    Offer,
    Precopy,
    PullPlan,
    pull_for,
)
from scheduler_svc.core.output import Scheduled, SchedulerOutput
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.prefetch import FETCH_TTL_MS, Fetch, Fetches, Round, fetch_kind, pull_key, request_of
from scheduler_svc.core.queue import make_queue
from scheduler_svc.core.record import Counters, StepRecord
from scheduler_svc.core.request import Finish, Request, Status
from scheduler_svc.core.spec import SpecConfig, Speculator

PREEMPTION_MODES = ("swap", "recompute")
ASK_TIMEOUT_MS = 2_000  # a request waiting for a peer's offer computes its prefix itself after this (a bound)
Source = Callable[[str, tuple[tuple[int, int], ...], int], KvSource]  # (lend id, blocks, tokens) -> where to read them


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    watermark: float = 0.01  # fraction of device blocks kept free when admitting
    enable_prefix_caching: bool = True  # --enable-prefix-caching (the BlockManager's ``caching``)
    max_loras: int = 0  # --max-loras: distinct LoRA adapters running at once (core/lora.py); 0: no limit
    spec: SpecConfig | None = None  # --speculative-config; None: no speculative decoding

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting = make_queue(config.policy)
        self.swapped = make_queue(config.policy)
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self.counters = Counters()  # totals since this scheduler was built
        self.record = StepRecord()  # what changed since the last take_record()
        self._eos = frozenset(config.eos_token_ids)
        self._watermark = int(config.watermark * blocks.total(DEVICE))
        self.spec = Speculator.of(config.spec) if config.spec is not None else None
        self._k = 0  # this step's draft length (``DraftPolicy``)
        self._spec_accepted = self._spec_rejections = 0  # drafts accepted and rows cut short, this update
        self.lending = Lending()  # blocks of requests that left with their KV (core/migration.py)
        self.fetches = Fetches()  # blocks pulled from peers ahead of their requests (core/prefetch.py)
        self.asking: dict[str, tuple[Request, int]] = {}  # waiting for a peer's offer of their prefix -> since
        self.costs = Costs.fresh()  # prefill against pulls, measured (core/costs.py)

    # -- intake ---------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Take in a request in whatever state it is (new, or reloaded from the store)."""
        self.requests[req.request_id] = req
        if req.status == Status.RUNNING:
            self.running.append(req)
        elif req.status == Status.SWAPPED:
            self.swapped.add(req)
        elif req.status == Status.WAITING:
            self.waiting.add(req)
        else:
            raise ValueError(f"{req.request_id} is already finished")

    def relink(self) -> None:
        """After a reload: group mates holding nothing wait again to fork (``group.relink``)."""
        group.relink(self.running)

    def fits_ever(self, req: Request) -> bool:
        """Whether ``req`` at its longest fits this executor's context and whole device pool."""
        return fits_ever(
            len(req.prompt_ids),
            req.params.max_tokens,
            req.num_tokens,
            self.blocks.block_size,
            self.blocks.total(DEVICE),
            self.config.max_model_len,
        )

    def _remove(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.lending.forget(req.request_id)
        self._drop_fetch(req.request_id)
        if self.asking.pop(req.request_id, None) is not None:
            return
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.SWAPPED:
            self.swapped.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)

    def finish(self, request_id: str, reason: Finish) -> Request | None:
        """End a request now (abort, or a stop string seen by the frontend)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._remove(req)
        self._orphan(req)
        self.blocks.free(req)
        if self.spec is not None:
            self.spec.proposer.finished(request_id, req.output_ids)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.record.finished.append(req)
        self._count("finished")
        return req

    def expire(self, now_ms: int) -> list[Request]:
        """Finish (``deadline``) the waiting and swapped requests whose queue deadline passed
        before they started; their blocks, swapped ones included, are freed."""
        gone = expired_among([*self.waiting, *self.swapped, *(r for r, _ in self.asking.values())], now_ms)
        for req in gone:
            self.finish(req.request_id, Finish.DEADLINE)
        return gone

    def requeue(self, req: Request) -> None:
        """``req`` leaves this executor for the shared queue, holding nothing: recomputed wherever it runs next
        (unless it left with its KV lent: ``migrate``)."""
        if req.kv is None or req.kv.lend not in self.lending.lends:
            self._count("moved_recomputed_tokens", req.num_computed)  # KV it loses by leaving
        self._remove(req)
        self._orphan(req)
        self.blocks.free(req)
        if self.spec is not None:
            self.spec.proposer.finished(req.request_id, ())
        req.num_computed = 0
        req.source = None
        req.status = Status.WAITING
        self.record.requeued.append(req)

    def requeue_waiting(self, now_ms: int | None = None) -> None:
        """End of a step: what was claimed but not admitted, or preempted for recompute, goes back (but for a
        request whose prefix was just fetched here: it waits here for room, ``ASK_TIMEOUT_MS`` at most from
        its fetch, as long as the loop says what time it is)."""
        for req in list(self.waiting):
            f = self.fetches.get(req.request_id)
            if f is None or not f.pulled or now_ms is None:
                self.requeue(req)
                continue
            f.hold_ms = f.hold_ms or now_ms + ASK_TIMEOUT_MS
            if now_ms >= f.hold_ms:
                self.requeue(req)

    def evacuate(self) -> None:
        """BlockMove every request elsewhere (the executor is draining and out of time)."""
        for req in [*self.running, *self.swapped, *self.waiting, *(r for r, _ in self.asking.values())]:
            self.requeue(req)

    def migrate(self, req: Request, source: Source, now_ms: int, cause: str = "drain", to: str = "") -> None:
        """``req`` (``migration.movable``) leaves for the shared queue with its KV: its blocks go to a
        lend, and ``source(lend id, blocks, tokens)`` names them in ``req.kv`` for its next executor
        (``to``, if its full blocks were pre-copied there: placement gives it that one)."""
        tokens, blocks = req.num_computed, self.blocks.lend(req)
        lent = Lent(f"{req.request_id}@{now_ms}", req.request_id, blocks, now_ms + LEND_TTL_MS)
        self.lending.lend(lent)
        self.record.lent.append(lent)
        req.kv = replace(source(lent.lend_id, tuple((int(t), b) for t, b in blocks), tokens), cause=cause, to=to)
        self._count("migrations_out")
        self._count(f"migrations_{cause}")
        self.requeue(req)

    def end_lend(self, lend_id: str) -> bool:
        """The destination has read (or given up on) a lend: its blocks come free."""
        lent = self.lending.end(lend_id)
        if lent is None:
            return False
        self.blocks.unlend(lent.blocks)
        self.record.unlent.append(lend_id)
        return True

    # -- KV that moves ahead of a request (core/migration.py: Offer, Ask; core/prefetch.py) -------

    def precopy(self, req: Request, to: str, source: Source, now_ms: int, cause: str, reserve: int = 0) -> bool:
        """Lend ``req``'s full blocks whose KV a reported step wrote (the ones named for the prefix cache: they
        never change) and not lent to ``to`` yet, while it keeps running here, and offer them to ``to``: one
        pre-copy round. ``reserve``: the blocks ``to`` should hold for the whole prefix (a prefill executor's
        handoff, whose later rounds fill them). A move (``cause`` drain, rebalance, preempt) makes one round;
        when its lend ends (``Lending.copied``), ``migrate`` lends only the rest. False: nothing new to lend
        (caching off, no full block yet, or no new one since the last round)."""
        pre = self.lending.precopies.get(req.request_id)
        start = pre.offered if pre is not None else 0
        n = min(req.num_registered, len(req.blocks))
        if n <= start or req.status != Status.RUNNING or req.request_id in self.lending.copied:
            return False
        if pre is not None and (pre.to != to or pre.cause != cause):
            return False
        blocks, hashes = req.blocks[start:n], self.blocks.hashes(req, n)[start:n]
        self.blocks.hold(blocks)
        refs = [(DEVICE, b) for b in blocks]
        lent = Lent(f"{req.request_id}@{now_ms}/pre{start}", req.request_id, refs, now_ms + OFFER_TTL_MS)
        src = source(lent.lend_id, tuple((int(t), b) for t, b in refs), n * self.blocks.block_size)
        src = replace(src, cause=cause, to=to)
        offer = Offer(to, req.request_id, src, tuple(h.hex() for h in hashes), start, reserve)
        self.lending.lend(lent, offer)
        if pre is None:
            pre = self.lending.precopies[req.request_id] = Precopy(req.request_id, to, cause)
            self._count("precopies")
        pre.lend_ids.append(lent.lend_id)
        pre.offered = n
        self.record.lent.append(lent)
        return True

    def answer(self, ask: Ask, source: Source, now_ms: int) -> None:
        """A peer asks for blocks of a prefix this pool caches (a peer prefix hit): lend the leading ones
        still cached here (held until the reader ends the lend) and offer them; with none, say so at once."""
        blocks = self.blocks.cached_prefix([bytes.fromhex(h) for h in ask.hashes]) if self.blocks.caching else []
        lend_id = f"{ask.request_id}@{now_ms}/{ask.reader}"
        tokens = (ask.start + len(blocks)) * self.blocks.block_size
        src = replace(source(lend_id, tuple((int(DEVICE), b) for b in blocks), tokens), cause="prefix", to=ask.reader)
        offer = Offer(ask.reader, ask.request_id, src, ask.hashes[: len(blocks)], ask.start)
        if not blocks:
            self.record.offers.append(offer)
            return
        self.blocks.hold(blocks)
        lent = Lent(lend_id, ask.request_id, [(DEVICE, b) for b in blocks], now_ms + OFFER_TTL_MS)
        self.lending.lend(lent, offer)
        self.record.lent.append(lent)

    def ask(self, req: Request, hits: dict[str, int], me: str, now_ms: int) -> Ask | None:
        """``req`` (just claimed, waiting) starts with more blocks cached on a peer than here: if pulling
        them costs less than computing them (``costs``), it waits for the peer's offer (``ASK_TIMEOUT_MS``
        at most) instead of being admitted, and the returned ``Ask`` goes to that peer."""
        if not self._may_ask(req):
            return None
        holder, n = max(((e, k) for e, k in hits.items() if e != me), key=lambda x: (x[1], x[0]), default=("", 0))
        bs = self.blocks.block_size
        n = min(n, prefix.lookup_limit(req.num_tokens, bs))
        mine = len(self.blocks.lookup(req))
        if n <= mine or not self.costs.pull_pays(n - mine, bs):
            return None
        hashes = self.blocks.hashes(req, n)[mine:n]
        self.waiting.remove(req)
        self.asking[req.request_id] = (req, now_ms)
        a = Ask(holder, req.request_id, me, tuple(h.hex() for h in hashes), mine)
        self.record.asks.append(a)
        self._count("peer_prefix_asks")
        return a

    def _may_ask(self, req: Request) -> bool:
        return (
            self.blocks.caching
            and self.requests.get(req.request_id) is req
            and req.status == Status.WAITING
            and req.request_id not in self.asking
            and req.request_id not in self.fetches
            and req.kv is None
            and not req.group
            and not req.num_computed
            and req.params.prompt_logprobs is None
        )

    def fetch(self, offer: Offer, now_ms: int) -> bool:
        """A peer lent blocks of a prefix for this pool (``Offer``): keep the leading ones cached here, put
        the rest into blocks of this pool (reserved by an earlier round, or new), pulled by the next plan
        and named in the cache once reported (core/prefetch.py). False (nothing to pull, no room, caching
        off): the lend is ended at once, and an asking request computes."""
        rid = offer.request_id
        asked = self.asking.get(rid)
        if asked is not None:
            self.costs.answered(now_ms - asked[1])
        hashes = [bytes.fromhex(h) for h in offer.hashes]
        f = self.fetches.get(rid)
        kept = self.blocks.cached_prefix(hashes) if self.blocks.caching else []
        need = len(hashes) - len(kept)
        if f is None and self.blocks.caching:
            f = self._reserve(offer, need, now_ms)
        if f is None or need <= 0 or not self._room(f, kept, need):
            if offer.src.blocks:
                self.record.rung.append(offer.src.lend)
            if f is not None and not f.blocks:
                self.fetches.pop(rid)
            self._asked(rid)
            return False
        self.blocks.hold(kept)
        f.blocks += kept
        dst = [f.spare.pop(0) for _ in range(min(need, len(f.spare)))]
        fresh = self.blocks.reserve(need - len(dst))
        f.blocks += fresh
        dst += fresh
        key = pull_key(rid, offer.start + len(kept))
        f.rounds[key] = Round(key, offer.src, len(kept), dst, hashes[len(kept) :])
        f.deadline_ms = now_ms + FETCH_TTL_MS
        self.record.lent.append(Lent(f.fid, rid, [(DEVICE, b) for b in f.blocks], f.deadline_ms))
        return True

    def _reserve(self, offer: Offer, need: int, now_ms: int) -> Fetch | None:
        """A request's first round here: a new fetch, holding the blocks the offer asks to reserve (a
        prefill executor's handoff: room for the whole prompt, committed now) when they fit."""
        f = Fetch(offer.request_id, offer.src.executor, now_ms + FETCH_TTL_MS)
        extra = offer.reserve - offer.start - need
        if extra > 0 and need + extra + self._watermark <= self.blocks.num_free(DEVICE):
            f.spare = self.blocks.reserve(extra)
            f.blocks = list(f.spare)
        self.fetches.add(f)
        return f

    def _room(self, f: Fetch, kept: list[int], need: int) -> bool:
        """Whether this round's ``need`` blocks fit: reserved ones, or free ones above the watermark (taking a
        kept block back from the evictable ones costs a free block too)."""
        short = max(0, need - len(f.spare)) + sum(1 for b in kept if b in self.blocks.lru)
        return short == 0 or short + self._watermark <= self.blocks.num_free(DEVICE)

    def _asked(self, request_id: str) -> None:
        """An asking request's wait is over (its fetch came back, or none came): it may be admitted."""
        entry = self.asking.pop(request_id, None)
        if entry is not None and self.requests.get(request_id) is entry[0]:
            self.waiting.add(entry[0])

    def _drop_fetch(self, request_id: str) -> None:
        """A fetch's request was admitted here (it holds the blocks itself now), left, or never came."""
        f = self.fetches.get(request_id)
        if f is None or f.in_flight:
            return  # a pull in flight may still write its blocks: it ends when reported
        self.fetches.pop(request_id)
        self.blocks.release(f.blocks)
        self.record.unlent.append(f.fid)

    def sources_gone(self, present: set[str]) -> None:
        """Fetches whose source left (``present``: the executors with a view): nothing more comes; what was
        pulled stays in the cache, and reserved blocks come free."""
        for rid in self.fetches.from_gone(present):
            self._drop_fetch(rid)

    def expire_moves(self, now_ms: int) -> None:
        """Lends nobody ended, fetches whose request never came, asks nobody answered: past their time."""
        for lend_id in self.lending.due(now_ms):
            self.end_lend(lend_id)
        for rid in self.fetches.due(now_ms):
            self._drop_fetch(rid)
        for rid, (_, since) in list(self.asking.items()):
            if now_ms - since >= ASK_TIMEOUT_MS:
                self._count("peer_prefix_timeouts")
                self._asked(rid)

    def _fetched(self, p: PullPlan, ok: bool, ms: float, size: int) -> None:
        """A fetch's pull was reported: its blocks are named in the cache (or go back to its spares), the
        source's lend can end, and the request that asked for it may be admitted."""
        rid = request_of(p.fetch)
        self.record.rung.append(p.src.lend)
        f = self.fetches.get(rid)
        r = f.rounds.pop(p.fetch, None) if f is not None else None
        if f is None or r is None:
            return
        self.costs.pulled(len(p.dst), ms)
        kind = fetch_kind(p.src.cause)
        if ok:
            f.pulled = True
            self.blocks.name(r.dst, r.hashes)
            self._count("fetched_blocks", len(p.dst))
            self._count("migrated_bytes", size)
            self._count(f"{kind}_blocks", len(p.dst))
        else:
            self._count("fetches_failed")
            f.spare += r.dst
            if not f.pulled and not f.rounds:
                self._drop_fetch(rid)  # nothing came: its blocks are of no use to anyone
        self.record.fetched.append((kind, ok, ms, len(p.dst)))
        self._asked(rid)

    def take_record(self) -> StepRecord:
        rec, self.record = self.record, StepRecord()
        rec.changed = self.blocks.take_changes()
        rec.cache = self.blocks.cache_delta(rec.changed[0])
        return rec

    def _count(self, name: str, n: int = 1) -> None:
        setattr(self.counters, name, getattr(self.counters, name) + n)
        setattr(self.record.counters, name, getattr(self.record.counters, name) + n)

    @property
    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting) or len(self.swapped) or self.lending.pending or self.fetches.new)

    @staticmethod
    def handing_off(req: Request) -> bool:
        """A prefill executor's request whose first token is sampled (or in flight): it runs nothing more
        here, and leaves for its decode executor once nothing of it is in flight (core/disagg.py)."""
        return bool(req.handoff) and bool(req.output_ids or req.num_unreported)

    def victim_order(self) -> list[Request]:
        """The running requests, the one preemption would take first first (``_victim``'s order)."""
        if self.config.policy == "fcfs":
            return self.running[::-1]
        return sorted(self.running, key=lambda r: r.order_key, reverse=True)

    # -- one step -------------------------------------------------------------

    def _victim(self, candidates: list[Request]) -> Request:
        """The least urgent: under FCFS the latest admitted, else (priority, arrival) largest. One that
        ends with its token in flight (pipelined) is passed over while another can go: it frees its
        blocks when that token is reported, and swapping it out would only move blocks about to be freed."""
        candidates = [r for r in candidates if not self._ending(r)] or candidates
        if self.config.policy == "fcfs":
            return candidates[-1]
        return max(candidates, key=lambda r: r.order_key)

    def _freed_soon(self) -> int:
        """Device blocks free by the next step: free now, swapped out by this plan, or held by requests
        whose tokens in flight end them (shared ones counted too: at worst a request waits a step more)."""
        return self.blocks.num_free_soon(DEVICE) + sum(len(r.blocks) for r in self.running if self._ending(r))

    def _ending(self, req: Request) -> bool:
        """Whether the tokens ``req`` has in flight end it by length (nothing more to run)."""
        return bool(req.num_unreported) and self._ends_by_length(req, len(req.output_ids) + req.num_unreported)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt ``victim`` and its running group mates (all or nothing); returns the tokens taken
        out of this step's plan."""
        mates = group.mates_running(self.running, victim)
        freed = 0
        for req in reversed(mates):  # prepended last to first: the group stays in index order
            freed += self._unschedule(req, out)
            self._preempt_one(req, out, recompute=len(mates) > 1)
        return freed

    def _preempt_one(self, victim: Request, out: SchedulerOutput, recompute: bool) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        victim.source = None
        victim.pulling = False  # a pull in flight for it no longer counts (``_pulled``)
        if (
            not recompute
            and self.config.preemption_mode == "swap"
            and victim.num_computed > 0
            and self.blocks.can_swap_out(victim)
        ):
            moves = self.blocks.swap_out(victim)
            out.swap_out.extend(moves)
            self._count("preemptions_swap")
            self._count("swapped_out_blocks", len(moves))
            self._count("disk_spilled_blocks", sum(m.dst_tier == DISK for m in moves))
            victim.status = Status.SWAPPED
            self.swapped.prepend(victim)
        else:
            self.blocks.free(victim)
            victim.num_computed = 0
            self._count("preemptions_recompute")
            victim.status = Status.WAITING
            self.waiting.prepend(victim)
        out.preempted.append(victim)
        self.record.touch(victim)

    def _unschedule(self, victim: Request, out: SchedulerOutput) -> int:
        """Drop ``victim`` from this step's plan if it was already in it (with the copy of its fork,
        if it forked in this plan); returns its tokens."""
        mine = set(victim.blocks)
        dropped = [m for m in out.copies if m.dst in mine]
        if dropped:
            out.copies = [m for m in out.copies if m.dst not in mine]
            self.blocks.release_copies(dropped)
        for i, s in enumerate(out.scheduled):
            if s.req is victim:
                del out.scheduled[i]
                return s.num_tokens
        return 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if self.config.policy == "priority":
            self.running.sort(key=lambda r: r.order_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._ending(req) or req.pulling or self.handing_off(req):
                i += 1
                continue  # its token in flight ends it (the pipelined loop), its KV is on its way, or it leaves
            if req.source is not None and not self._fork(req, out):
                i += 1
                continue  # its source has not launched the whole prompt yet, or no block for the copy
            n = min(req.num_pending, budget)
            preempted = False
            need = self.blocks.needed(req, n)  # 0 for most decode steps: room left in its last block
            fits = need <= self.blocks.num_free(DEVICE)
            while not fits:
                if need <= self._freed_soon():
                    break  # swaps in this plan, or requests ending in flight, free enough for the next step
                victim = self._victim(self.running)
                budget += self._preempt(victim, out)
                preempted = True
                if req.status != Status.RUNNING:
                    break  # it was the victim, or in the victim's group
                fits = need <= self.blocks.num_free(DEVICE)  # ``need`` is its own: others' preemption leaves it
            if req.status != Status.RUNNING:
                continue  # preempted itself: running[i] is now the next request
            # Victims ahead of it (priority policy) shift it towards the front.
            i = self.running.index(req) + 1 if preempted else i + 1
            if not fits:
                continue  # waits one step for swapped-out blocks to come free
            drafts = self._drafts(req, budget - n) if self._k and n == 1 else []
            self.blocks.append(req, n + len(drafts))
            out.scheduled.append(Scheduled(req, req.num_computed, n + len(drafts), drafts))
            self.record.touch(req)
            budget -= n + len(drafts)
        return budget

    # -- speculative decoding (core/spec.py) ----------------------------------------

    def _draftable(self, req: Request) -> bool:
        """A decoding request whose last token is known (none in flight: the pipelined loop's next plan
        drafts nothing for it)."""
        return req.num_unreported == 0 and bool(req.output_ids) and req.num_pending == 1 and req.source is None

    def wants_drafts(self) -> bool:
        """Whether the next step would draft if its decoding requests' last tokens were known: a pipelined
        loop then waits for the result in flight before planning (drafts need the last token)."""
        if self.spec is None:
            return False
        rows = sum(1 for r in self.running if r.source is None and r.num_pending <= 1 and r.num_tokens > r.num_prompt)
        tokens = min(self.config.max_num_batched_tokens, sum(max(1, r.num_pending) for r in self.running))
        return self.spec.policy.choose(rows, tokens) > 0

    def _choose_k(self) -> None:
        """This step's draft length, from the decoding rows that could draft and the step's tokens."""
        self._k = 0
        if self.spec is None:
            return
        rows = sum(1 for r in self.running if self._draftable(r))
        tokens = min(self.config.max_num_batched_tokens, sum(max(0, r.num_pending) for r in self.running))
        self._k = self.spec.policy.choose(rows, tokens)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Up to ``self._k`` drafts for ``req``, within the budget, its max_tokens, the context and the free
        blocks above the watermark (drafts never preempt anyone)."""
        if not self._draftable(req):
            return []
        assert self.spec is not None
        k = min(
            self._k,
            budget,
            req.params.max_tokens - len(req.output_ids) - 1,
            self.config.max_model_len - req.num_tokens,
        )
        if k < 1:
            return []
        drafts = self.spec.proposer.propose(req.request_id, req.prompt_ids + req.output_ids, k)[:k]
        free = self.blocks.num_free(DEVICE) - self._watermark
        while drafts and self.blocks.needed(req, 1 + len(drafts)) > free:
            drafts.pop()
        return drafts

    # -- parallel-sampling groups -------------------------------------------------

    def _fork(self, req: Request, out: SchedulerOutput) -> bool:
        """A waiting group mate forks from its source once the source has launched its whole prompt:
        it shares the KV of all prompt tokens but the last, which it computes itself (it samples its
        own first token from there). False while it must wait."""
        src = req.source
        assert src is not None
        upto = len(src.prompt_ids) - 1
        if src.num_computed <= upto or self.blocks.fork_cost(upto) > self.blocks.num_free(DEVICE):
            return False
        copy = self.blocks.fork(src, req, upto)
        if copy is not None:
            out.copies.append(copy)
        req.source = None
        self.record.touch(req)
        self._count("forked_tokens", upto)
        return True

    def _orphan(self, src: Request) -> None:
        """``src`` leaves (finished, requeued) while group mates still wait to fork from it: the first
        of them takes over its computed full prompt blocks (no copy: ``src`` writes no more) and
        computes the rest itself; the others wait for that one."""
        mates = group.waiting_on(self.running, src)
        if not mates:
            return
        heir, bs = mates[0], self.blocks.block_size
        heir.source = None
        self.record.touch(heir)
        upto = min(src.num_computed, len(src.prompt_ids) - 1) // bs * bs
        if upto:
            self.blocks.fork(src, heir, upto)
            self._count("forked_tokens", upto)
        for m in mates[1:]:
            m.source = heir

    def _next_candidate(self) -> tuple[Request, bool] | None:
        """The most urgent of the swapped and waiting heads; ``True`` if swapped."""
        s, w = self.swapped.peek(), self.waiting.peek()
        if s is None or w is None:
            return (s, True) if s is not None else ((w, False) if w is not None else None)
        if self.config.policy == "fcfs" or s.order_key <= w.order_key:
            return s, True
        return w, False

    def _fits(self, req: Request, n: int, from_swap: bool, hit: list[int], mates: list[Request]) -> bool:
        """Whether ``req`` and the group ``mates`` it brings along fit (seats, and device blocks
        beyond the watermark)."""
        if len(self.running) + 1 + len(mates) > self.config.max_num_seqs:
            return False
        reserve = (self._watermark if self.running else 0) + group.fork_need(req, mates, self.blocks.block_size)
        if from_swap:
            return self.blocks.can_swap_in(req, n, reserve)
        return self.blocks.can_allocate(req, hit, n, reserve)

    def _need(self, req: Request, n: int, from_swap: bool, hit: list[int], mates: list[Request]) -> int:
        """Free device blocks admitting ``req`` and its ``mates`` costs."""
        if from_swap:
            return blocks_for(req.num_computed + n, self.blocks.block_size)
        bs = self.blocks.block_size
        return (
            blocks_for(len(hit) * bs + n, bs)
            - len(hit)
            + sum(1 for b in hit if b in self.blocks.lru)
            + group.fork_need(req, mates, self.blocks.block_size)
        )

    def _make_room(
        self, req: Request, n: int, from_swap: bool, out: SchedulerOutput, hit: list[int], mates: list[Request]
    ) -> bool:
        """Under ``priority``, preempt less urgent running requests for ``req``.

        Returns whether ``req`` fits now; after swap-outs it fits only next step.
        """
        if self.config.policy != "priority":
            return False
        while not self._fits(req, n, from_swap, hit, mates):
            reserve = self._watermark if self.running else 0
            if self._need(req, n, from_swap, hit, mates) + reserve <= self._freed_soon():
                return False  # enough is already on its way back
            lower = [r for r in self.running if r.order_key > req.order_key]
            if not lower:
                return False
            victim = self._victim(lower)
            self._preempt(victim, out)
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            head = self._next_candidate()
            if head is None:
                return
            req, from_swap = head
            if not lora.admits(self.running, req, self.config.max_loras):
                return  # head-of-line: its adapter waits for a slot (core/lora.py)
            hit = [] if from_swap else self.blocks.lookup(req)
            pull = 0 if from_swap else pull_for(req, hit, self.blocks.block_size)
            n = pull or min(budget, req.num_pending - len(hit) * self.blocks.block_size)
            mates = [] if from_swap else group.mates_waiting(self.waiting, req)
            while not (
                self._fits(req, n, from_swap, hit, mates) or self._make_room(req, n, from_swap, out, hit, mates)
            ):
                if not mates or self.running:
                    return  # head-of-line: later requests wait for this one (a group, for all of it)
                mates.pop()  # nothing runs and the whole group never fits: as many as fit
            if from_swap:
                self.swapped.pop()
                moves = self.blocks.swap_in(req)
                out.swap_in.extend(moves)
                self._count("swapped_in_blocks", len(moves))
                self.blocks.append(req, n)
            else:
                self.waiting.pop()
                self._start(req, hit, n)
            req.status = Status.RUNNING
            self.running.append(req)
            self.record.touch(req)
            if pull:  # its KV comes from a peer while this step runs; it computes from the next step
                assert req.kv is not None
                req.pulling = True
                out.pulls.append(PullPlan(req, req.kv, len(hit), req.blocks[len(hit) :]))
                continue
            if req.kv is not None:  # its own prefix cache had at least what the peer lent
                self.record.pulled.append((req, req.kv))
                self.record.pull_ms.append((True, 0.0, 0))
                req.kv = None
            out.scheduled.append(Scheduled(req, req.num_computed, n))
            budget -= n
            for m in mates:  # they wait, holding nothing, to fork from ``req`` (``_fork``)
                self.waiting.remove(m)
                m.status, m.source = Status.RUNNING, req
                self.running.append(m)
                self.record.touch(m)

    def _start(self, req: Request, hit: list[int], n: int) -> None:
        """A waiting request (holding nothing) takes its cached prefix and room for ``n`` tokens."""
        self.blocks.allocate(req, hit, n)
        self._drop_fetch(req.request_id)  # its hit holds what was fetched for it
        if self.blocks.caching:
            self._count("prefix_cache_queries", req.num_tokens)
            self._count("prefix_cache_hits", req.num_computed)
        if not req.output_ids:
            req.num_cached = req.num_computed

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.lends, out.unlends, offers = self.lending.take()
        self.record.offers += offers  # told once this plan (lending their blocks) is reported: the commit waits
        for r in self.fetches.take():
            out.pulls.append(PullPlan(None, r.src, r.first, r.dst, r.key))
        self._choose_k()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit(out, budget)
        if out.has_work:
            self._count("steps")
        return out

    def launch(self, out: SchedulerOutput) -> None:
        """The plan goes to the executor: its tokens count as computed, and each sequence it
        samples owes one output token, unknown until ``update`` (so the next step can be
        planned before this one's result is in)."""
        for s in out.scheduled:
            s.req.num_computed = s.end  # drafts count once accepted (``update``)
            s.req.num_unreported += s.samples
        out.launched = True

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: dict[str, Logprob] | None = None,
        prompt_logprobs: dict[str, dict[int, Logprob]] | None = None,
        more: dict[str, list[int]] | None = None,
        more_logprobs: dict[str, list[Logprob]] | None = None,
        pulled: dict[str, tuple[bool, float, int]] | None = None,
    ) -> list[Request]:
        """Apply the executor's report of a launched plan (launching it first if the caller did
        not): its swaps' sources come free, sampled tokens join their requests (with their
        logprobs, and the prompt's, opaque here); returns the requests it finished. A token of a
        request that ended or left this scheduler since the launch (an abort, an earlier finish, a
        requeue) is dropped: it was never streamed. ``more``: for a row with drafts, the tokens after
        its first (the accepted drafts, then the executor's own next token), taken one by one until
        one finishes the request; ``more_logprobs``: theirs. ``pulled``: each pull's (ok, ms, bytes)."""
        if not out.launched:
            self.launch(out)
        self._pulled(out.pulls, pulled or {})
        self.blocks.release_pending(out.swap_out + out.swap_in)
        self.blocks.release_copies(out.copies)
        finished: list[Request] = []
        generated = 0
        new_tokens, touched = self.record.new_tokens, self.record.touched
        for s in out.scheduled:
            req = s.req
            rid = req.request_id
            live = self.requests.get(rid) is req
            if live:  # the KV this step wrote is in: name its full blocks for others (core/prefix.py),
                if not s.drafts:  # (a row with drafts: once it is known which of them count)
                    self.blocks.cache(req, s.end)
                touched[rid] = req  # and commit what it computed (a pipelined commit wrote only its start)
            if prompt_logprobs and rid in prompt_logprobs and live:
                self.record.prompt_logprobs.setdefault(rid, {}).update(prompt_logprobs[rid])
            if not s.samples:
                continue
            req.num_unreported -= 1
            token = sampled.get(rid)
            if not live:
                continue
            emitted = [] if token is None else [token]
            if s.drafts:
                emitted += (more or {}).get(rid, [])[: len(s.drafts)]
                self._accept(req, s, len(emitted) - 1 if emitted else 0)
            reason = None
            if emitted and req.moved_at_ms:
                self.record.stalls.append(req.moved_at_ms)
                req.moved_at_ms = 0
            for i, token in enumerate(emitted):
                req.output_ids.append(token)
                new_tokens.setdefault(rid, []).append(token)
                if i == 0 and logprobs and rid in logprobs:
                    self.record.logprobs.setdefault(rid, []).append(logprobs[rid])
                elif i and more_logprobs and len(more_logprobs.get(rid, ())) >= i:
                    self.record.logprobs.setdefault(rid, []).append(more_logprobs[rid][i - 1])
                generated += 1
                reason = self._check_finish(req, token)
                if reason is not None:
                    break
            if s.drafts:
                self.blocks.cache(req, min(req.num_computed, req.num_known))
            if reason is not None:
                self.finish(rid, reason)
                finished.append(req)
        self._count("generated_tokens", generated)
        if self.spec is not None:
            self.spec.policy.observe(self._spec_accepted, self._spec_rejections)
            self._spec_accepted = self._spec_rejections = 0
        return finished

    def _pulled(self, pulls: list[PullPlan], results: dict[str, tuple[bool, float, int]]) -> None:
        """Reported pulls: what came counts as computed (and is named in the prefix cache); a request
        whose pull failed computes from its own prefix hit on. Either way its source's lend can end."""
        for p in pulls:
            ok, ms, size = results.get(p.key, (False, 0.0, 0))
            if p.req is None:
                self._fetched(p, ok, ms, size)
                continue
            req, rid = p.req, p.req.request_id
            self.record.pulled.append((req, p.src))
            self.record.pull_ms.append((ok, ms, size))
            req.kv = None
            if self.requests.get(rid) is not req or not req.pulling or req.status != Status.RUNNING:
                continue  # finished, preempted or gone since: nothing of the pull counts
            req.pulling, req.moved_at_ms = False, p.src.at_ms
            if ok:
                req.num_computed = p.src.tokens
                self.blocks.cache(req, req.num_computed)
                self.costs.pulled(len(p.dst), ms)
                self._count("migrations_in")
                self._count("migrated_blocks", len(p.dst))
                self._count("migrated_bytes", size)
            else:
                self._count("migrations_failed")
                self._count("moved_recomputed_tokens", p.src.tokens - req.num_computed)
            self.record.touch(req)

    def _accept(self, req: Request, s: Scheduled, accepted: int) -> None:
        """A row with drafts came back with ``accepted`` of them: only those count as computed, and
        blocks reserved for rejected positions past the next token's are freed."""
        if req.num_computed == s.end:  # else it was preempted or restarted since (nothing of this step counts)
            req.num_computed = s.end + accepted
            self.blocks.trim(req, req.num_computed + 1)
        self._count("spec_drafts")
        self._count("spec_draft_tokens", len(s.drafts))
        self._count("spec_accepted_tokens", accepted)
        self.record.spec_accepted_per_pos.extend([0] * (len(s.drafts) - len(self.record.spec_accepted_per_pos)))
        for j in range(accepted):
            self.record.spec_accepted_per_pos[j] += 1
        self._spec_accepted += accepted
        self._spec_rejections += accepted < len(s.drafts)

    def _ends_by_length(self, req: Request, num_output: int) -> bool:
        """Whether ``num_output`` output tokens end ``req`` by length (max_tokens or the context)."""
        return num_output >= req.params.max_tokens or len(req.prompt_ids) + num_output >= self.config.max_model_len

    def _check_finish(self, req: Request, token: int) -> Finish | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self._eos):
            return Finish.STOP
        if self._ends_by_length(req, len(req.output_ids)):
            return Finish.LENGTH
        return None

    # -- views ----------------------------------------------------------------

    def room(self) -> tuple[int, int]:
        """(sequences, tokens) a step could still admit after the running requests' decodes."""
        pending = sum(r.num_pending for r in self.running)
        return self.config.max_num_seqs - len(self.running), max(0, self.config.max_num_batched_tokens - pending)

    def view(self, executor: str, serving: bool, role: str = "mixed") -> PoolView:
        """This pool as placement sees it (published for the other loops each step)."""
        held: Counter[int] = Counter()
        for r in self.running:
            held[r.priority] += len(r.blocks)
        b = self.blocks
        return PoolView(
            executor=executor,
            serving=serving,
            block_size=b.block_size,
            blocks=tuple(b.total(t) for t in TIERS),
            free=tuple(b.num_free(t) for t in TIERS),
            running=len(self.running),
            swapped=len(self.swapped),
            max_model_len=self.config.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            watermark=self._watermark,
            held=dict(held),
            max_loras=self.config.max_loras,
            adapters=tuple(sorted(lora.adapters_of([*self.running, *self.swapped]))) if self.config.max_loras else (),
            role=role,
        )
