"""KV that moves between executors, one executor's scheduler side: the ``Transfers`` its ``Scheduler`` owns.

What leaves (``migrate``: a request and a lend of its blocks; ``precopy``: a round of a running request's
full blocks; ``answer``: cached blocks a peer asked for), what comes (``fetch``: an offer's blocks pulled into
this pool's cache ahead of their request; ``pulled``: a moved request's own pull), and what waits
(``ask``: a request waiting for a peer's cached prefix). The protocol and its failure cases are
docs/architecture.md, "KV that moves"; the plain data are core/migration.py and core/prefetch.py; the costs
that decide a peer prefix hit are core/costs.py. Pure, like the scheduler it belongs to: the loop's
``Mover`` (loops/moves.py) reads doorbells and views and calls in here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from scheduler_svc.core import prefix
from scheduler_svc.core.blocks import DEVICE
from scheduler_svc.core.costs import Costs
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
)
from scheduler_svc.core.prefetch import FETCH_TTL_MS, Fetch, Fetches, Round, fetch_kind, pull_key, request_of
from scheduler_svc.core.request import Request, Status

if TYPE_CHECKING:
    from scheduler_svc.core.output import SchedulerOutput
    from scheduler_svc.core.scheduler import Scheduler

ASK_TIMEOUT_MS = 2_000  # a request waiting for a peer's offer computes its prefix itself after this (a bound)
Source = Callable[[str, tuple[tuple[int, int], ...], int], KvSource]  # (lend id, blocks, tokens) -> where to read them


class Transfers:
    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.lending = Lending()  # blocks lent to peers (core/migration.py)
        self.fetches = Fetches()  # blocks pulled from peers ahead of their requests (core/prefetch.py)
        self.asking: dict[str, tuple[Request, int]] = {}  # waiting for a peer's offer of their prefix -> since
        self.costs = Costs.fresh()  # prefill against pulls, measured (core/costs.py)

    @property
    def pending(self) -> bool:
        """Something for the next plan: lends to register or end, fetch rounds to pull."""
        return self.lending.pending or self.fetches.new

    def plan(self, out: SchedulerOutput) -> None:
        """Into the next plan: lends to register and end, and fetch rounds to pull. The offers of those lends
        go into the record: told once this plan is reported (the commit waits for a plan that lends)."""
        out.lends, out.unlends, offers = self.lending.take()
        self.s.record.offers += offers
        for r in self.fetches.take():
            out.pulls.append(PullPlan(None, r.src, r.first, r.dst, r.key))

    def migrate(self, req: Request, source: Source, now_ms: int, cause: str = "drain", to: str = "") -> None:
        """``req`` (``migration.movable``) leaves for the shared queue with its KV: its blocks go to a
        lend, and ``source(lend id, blocks, tokens)`` names them in ``req.kv`` for its next executor
        (``to``, if its full blocks were pre-copied there: placement gives it that one)."""
        tokens, blocks = req.num_computed, self.s.blocks.lend(req)
        lent = Lent(f"{req.request_id}@{now_ms}", req.request_id, blocks, now_ms + LEND_TTL_MS)
        self.lending.lend(lent)
        self.s.record.lent.append(lent)
        req.kv = replace(source(lent.lend_id, tuple((int(t), b) for t, b in blocks), tokens), cause=cause, to=to)
        self.s.count("migrations_out")
        self.s.count(f"migrations_{cause}")
        self.s.requeue(req)

    def end_lend(self, lend_id: str) -> bool:
        """The destination has read (or given up on) a lend: its blocks come free."""
        lent = self.lending.end(lend_id)
        if lent is None:
            return False
        self.s.blocks.unlend(lent.blocks)
        self.s.record.unlent.append(lend_id)
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
        blocks, hashes = req.blocks[start:n], self.s.blocks.hashes(req, n)[start:n]
        self.s.blocks.hold(blocks)
        refs = [(DEVICE, b) for b in blocks]
        lent = Lent(f"{req.request_id}@{now_ms}/pre{start}", req.request_id, refs, now_ms + OFFER_TTL_MS)
        src = source(lent.lend_id, tuple((int(t), b) for t, b in refs), n * self.s.blocks.block_size)
        src = replace(src, cause=cause, to=to)
        offer = Offer(to, req.request_id, src, tuple(h.hex() for h in hashes), start, reserve)
        self.lending.lend(lent, offer)
        if pre is None:
            pre = self.lending.precopies[req.request_id] = Precopy(req.request_id, to, cause)
            self.s.count("precopies")
        pre.lend_ids.append(lent.lend_id)
        pre.offered = n
        self.s.record.lent.append(lent)
        return True

    def answer(self, ask: Ask, source: Source, now_ms: int) -> None:
        """A peer asks for blocks of a prefix this pool caches (a peer prefix hit): lend the leading ones
        still cached here (held until the reader ends the lend) and offer them; with none, say so at once."""
        blocks = self.s.blocks.cached_prefix([bytes.fromhex(h) for h in ask.hashes]) if self.s.blocks.caching else []
        lend_id = f"{ask.request_id}@{now_ms}/{ask.reader}"
        tokens = (ask.start + len(blocks)) * self.s.blocks.block_size
        src = replace(source(lend_id, tuple((int(DEVICE), b) for b in blocks), tokens), cause="prefix", to=ask.reader)
        offer = Offer(ask.reader, ask.request_id, src, ask.hashes[: len(blocks)], ask.start)
        if not blocks:
            self.s.record.offers.append(offer)
            return
        self.s.blocks.hold(blocks)
        lent = Lent(lend_id, ask.request_id, [(DEVICE, b) for b in blocks], now_ms + OFFER_TTL_MS)
        self.lending.lend(lent, offer)
        self.s.record.lent.append(lent)

    def ask(self, req: Request, hits: dict[str, int], me: str, now_ms: int) -> Ask | None:
        """``req`` (just claimed, waiting) starts with more blocks cached on a peer than here: if pulling
        them costs less than computing them (``costs``), it waits for the peer's offer (``ASK_TIMEOUT_MS``
        at most) instead of being admitted, and the returned ``Ask`` goes to that peer."""
        if not self._may_ask(req):
            return None
        holder, n = max(((e, k) for e, k in hits.items() if e != me), key=lambda x: (x[1], x[0]), default=("", 0))
        bs = self.s.blocks.block_size
        n = min(n, prefix.lookup_limit(req.num_tokens, bs))
        mine = len(self.s.blocks.lookup(req))
        if n <= mine or not self.costs.pull_pays(n - mine, bs):
            return None
        hashes = self.s.blocks.hashes(req, n)[mine:n]
        self.s.waiting.remove(req)
        self.asking[req.request_id] = (req, now_ms)
        a = Ask(holder, req.request_id, me, tuple(h.hex() for h in hashes), mine)
        self.s.record.asks.append(a)
        self.s.count("peer_prefix_asks")
        return a

    def _may_ask(self, req: Request) -> bool:
        return (
            self.s.blocks.caching
            and self.s.requests.get(req.request_id) is req
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
        kept = self.s.blocks.cached_prefix(hashes) if self.s.blocks.caching else []
        need = len(hashes) - len(kept)
        if f is None and self.s.blocks.caching:
            f = self._reserve(offer, need, now_ms)
        if f is None or need <= 0 or not self._room(f, kept, need):
            if offer.src.blocks:
                self.s.record.rung.append(offer.src.lend)
            if f is not None and not f.blocks:
                self.fetches.pop(rid)
            self._answered(rid)
            return False
        self.s.blocks.hold(kept)
        f.blocks += kept
        dst = [f.spare.pop(0) for _ in range(min(need, len(f.spare)))]
        fresh = self.s.blocks.reserve(need - len(dst))
        f.blocks += fresh
        dst += fresh
        key = pull_key(rid, offer.start + len(kept))
        f.rounds[key] = Round(key, offer.src, len(kept), dst, hashes[len(kept) :])
        f.deadline_ms = now_ms + FETCH_TTL_MS
        self.s.record.lent.append(Lent(f.fid, rid, [(DEVICE, b) for b in f.blocks], f.deadline_ms))
        return True

    def _reserve(self, offer: Offer, need: int, now_ms: int) -> Fetch | None:
        """A request's first round here: a new fetch, holding the blocks the offer asks to reserve (a
        prefill executor's handoff: room for the whole prompt, committed now) when they fit."""
        f = Fetch(offer.request_id, offer.src.executor, now_ms + FETCH_TTL_MS)
        extra = offer.reserve - offer.start - need
        if extra > 0 and need + extra + self.s.watermark <= self.s.blocks.num_free(DEVICE):
            f.spare = self.s.blocks.reserve(extra)
            f.blocks = list(f.spare)
        self.fetches.add(f)
        return f

    def _room(self, f: Fetch, kept: list[int], need: int) -> bool:
        """Whether this round's ``need`` blocks fit: reserved ones, or free ones above the watermark (taking a
        kept block back from the evictable ones costs a free block too)."""
        short = max(0, need - len(f.spare)) + sum(1 for b in kept if b in self.s.blocks.lru)
        return short == 0 or short + self.s.watermark <= self.s.blocks.num_free(DEVICE)

    def _answered(self, request_id: str) -> None:
        """An asking request's wait is over (its fetch came back, or none came): it may be admitted."""
        entry = self.asking.pop(request_id, None)
        if entry is not None and self.s.requests.get(request_id) is entry[0]:
            self.s.waiting.add(entry[0])

    def drop_fetch(self, request_id: str) -> None:
        """A fetch's request was admitted here (it holds the blocks itself now), left, or never came."""
        f = self.fetches.get(request_id)
        if f is None or f.in_flight:
            return  # a pull in flight may still write its blocks: it ends when reported
        self.fetches.pop(request_id)
        self.s.blocks.release(f.blocks)
        self.s.record.unlent.append(f.fid)

    def sources_gone(self, present: set[str]) -> None:
        """Fetches whose source left (``present``: the executors with a view): nothing more comes; what was
        pulled stays in the cache, and reserved blocks come free."""
        for rid in self.fetches.from_gone(present):
            self.drop_fetch(rid)

    def expire(self, now_ms: int) -> None:
        """Lends nobody ended, fetches whose request never came, asks nobody answered: past their time."""
        for lend_id in self.lending.due(now_ms):
            self.end_lend(lend_id)
        for rid in self.fetches.due(now_ms):
            self.drop_fetch(rid)
        for rid, (_, since) in list(self.asking.items()):
            if now_ms - since >= ASK_TIMEOUT_MS:
                self.s.count("peer_prefix_timeouts")
                self._answered(rid)

    def _fetched(self, p: PullPlan, ok: bool, ms: float, size: int) -> None:
        """A fetch's pull was reported: its blocks are named in the cache (or go back to its spares), the
        source's lend can end, and the request that asked for it may be admitted."""
        rid = request_of(p.fetch)
        self.s.record.rung.append(p.src.lend)
        f = self.fetches.get(rid)
        r = f.rounds.pop(p.fetch, None) if f is not None else None
        if f is None or r is None:
            return
        self.costs.pulled(len(p.dst), ms)
        kind = fetch_kind(p.src.cause)
        if ok:
            f.pulled = True
            self.s.blocks.name(r.dst, r.hashes)
            self.s.count("fetched_blocks", len(p.dst))
            self.s.count("migrated_bytes", size)
            self.s.count(f"{kind}_blocks", len(p.dst))
        else:
            self.s.count("fetches_failed")
            f.spare += r.dst
            if not f.pulled and not f.rounds:
                self.drop_fetch(rid)  # nothing came: its blocks are of no use to anyone
        self.s.record.fetched.append((kind, ok, ms, len(p.dst)))
        self._answered(rid)

    def pulled(self, pulls: list[PullPlan], results: dict[str, tuple[bool, float, int]]) -> None:
        """Reported pulls: what came counts as computed (and is named in the prefix cache); a request
        whose pull failed computes from its own prefix hit on. Either way its source's lend can end."""
        for p in pulls:
            ok, ms, size = results.get(p.key, (False, 0.0, 0))
            if p.req is None:
                self._fetched(p, ok, ms, size)
                continue
            req, rid = p.req, p.req.request_id
            self.s.record.pulled.append((req, p.src))
            self.s.record.pull_ms.append((ok, ms, size))
            req.kv = None
            if self.s.requests.get(rid) is not req or not req.pulling or req.status != Status.RUNNING:
                continue  # finished, preempted or gone since: nothing of the pull counts
            req.pulling, req.moved_at_ms = False, p.src.at_ms
            if ok:
                req.num_computed = p.src.tokens
                self.s.blocks.cache(req, req.num_computed)
                self.costs.pulled(len(p.dst), ms)
                self.s.count("migrations_in")
                self.s.count("migrated_blocks", len(p.dst))
                self.s.count("migrated_bytes", size)
            else:
                self.s.count("migrations_failed")
                self.s.count("moved_recomputed_tokens", p.src.tokens - req.num_computed)
            self.s.record.touch(req)
