"""One loop's side of KV that moves between executors (docs/architecture.md, "KV that moves").

Every turn the loop hands its doorbells to ``Mover.doorbells``: a peer's
``unlend`` ends a lend of ours, an ``offer`` addressed to us becomes a fetch
(core/prefetch.py), an ``ask`` addressed to us is answered with a lend of the
cached blocks asked for. Then, by the executor's state:

- **draining** (``drain``): requests a serving peer has room for leave with
  their KV (``--migration kv``) or by recompute. A running request is first
  pre-copied (its full blocks lent to the chosen peer, which pulls them into
  its cache while the request keeps decoding here); once that lend ends, one
  short stop lends the rest and requeues it for that peer. A swapped request,
  or one with nothing to pre-copy, makes the short stop at once;
- **serving, with ``--rebalance``** (``rebalance``): the same moves, for the
  requests ``core/rebalance.py`` picks (before a preemption, or over a usage
  gap), at most every ``--rebalance-every-ms``;
- **serving, with ``--peer-prefix``** (``ask``): each request just claimed whose
  prefix a peer caches further than we do waits for that peer's offer when the
  pull costs less than the prefill (``core/costs.py``).

A short stop needs nothing of its request in flight, so the loop holds its next
plan until the pipeline is empty (``drain``/``rebalance`` return ``True``).
Decisions are the pure core's; this module reads views and calls the scheduler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedserve.members import Member, now_ms
from scheduler_svc.core import disagg, migration
from scheduler_svc.core import rebalance as balance
from scheduler_svc.core.disagg import PREFILL
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.migration import KvSource, MoveConfig
from scheduler_svc.core.placement import Candidate, PoolView
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler, Source
from scheduler_svc.state import codec
from scheduler_svc.state.store import Op

log = logging.getLogger(__name__)
_NOT_SERVING = PoolView("", False, 0, (0, 0, 0), (0, 0, 0), 0, 0, 0, 0)  # a pool missing from the views


@dataclass(slots=True)
class Mover:
    executor: str
    epoch: int
    block_size: int
    config: MoveConfig
    role: str = "mixed"  # its executor's --role
    _next_check_ms: int = 0  # when a serving loop next reads the views for rebalancing and sources gone

    def source(self, member: Member) -> Source:
        """Names a lend of ours for a reader: this executor's address and our epoch."""
        at = now_ms()
        return lambda lend_id, blocks, tokens: KvSource(
            self.executor, member.address, self.epoch, lend_id, blocks, tokens, at
        )

    def doorbells(self, sched: Scheduler, ops: list[Op], member: Member) -> None:
        """Peers' doorbells about moving KV, then whatever outlived its time."""
        now = now_ms()
        for o in ops:
            if o.op == "unlend":  # a reader read (or gave up on) blocks this executor lent
                sched.moves.end_lend(o.request_id)
            elif o.to != self.executor:
                continue
            elif o.op == "offer":
                sched.moves.fetch(codec.offer_from(o.to, o.request_id, o.data), now)
            elif o.op == "ask":
                sched.moves.answer(codec.ask_from(o.to, o.request_id, o.data), self.source(member), now)
        sched.moves.expire(now)

    def ask(self, sched: Scheduler, claimed: list[Request], candidates: dict[str, Candidate]) -> None:
        """Requests just claimed whose prefix a peer caches further: ask it, if pulling pays."""
        if not self.config.peer_prefix:
            return
        now = now_ms()
        for req in claimed:
            c = candidates.get(req.request_id)
            if c is not None and c.hits:
                sched.moves.ask(req, c.hits, self.executor, now)

    def drain(self, sched: Scheduler, member: Member, views: dict[str, PoolView], busy: bool) -> bool:
        """A draining executor's moves (``--migration``); ``busy``: a plan is in flight. Returns whether
        to hold plans until none is (a short stop is due)."""
        if self.config.migration == "off":
            return False
        order = sorted(sched.running, key=lambda r: r.order_key) + list(sched.swapped)
        candidates = [r for r in order if migration.movable(r) and not sched.moves.lending.moving(r.request_id)]
        picks = [
            balance.Move(req, to, "drain")
            for req, to in migration.pick(candidates, views, self.executor, self.block_size)
        ]
        self._readers_gone(sched, views if views else None)
        return self._move(sched, member, picks, busy)

    def wants_views(self, sched: Scheduler, member: Member) -> bool:
        """Whether this turn needs the pools' views (one Redis read): a drain with something to move or a
        pre-copy whose reader may have left; a rebalance check that is due; a prefill executor's requests
        (their decode executors); fetches whose source may have left (checked every rebalance period)."""
        now = now_ms()
        if not member.serving:
            return self.config.migration != "off" and (
                bool(sched.moves.lending.precopies)
                or any(
                    migration.movable(r) and not sched.moves.lending.moving(r.request_id)
                    for r in [*sched.running, *sched.swapped]
                )
            )
        if self.role == PREFILL and sched.running:
            return True
        due = now >= self._next_check_ms
        return due and bool(
            (self.config.rebalance and sched.running) or sched.moves.lending.precopies or sched.moves.fetches
        )

    def serve(self, sched: Scheduler, member: Member, views: dict[str, PoolView] | None, busy: bool) -> bool:
        """A serving executor's moves: rebalancing (``--rebalance``), a prefill executor's handoffs, and
        fetches whose source left. Returns whether to hold plans (a short stop is due)."""
        picks: list[balance.Move] = []
        if views is not None:
            self._next_check_ms = now_ms() + self.config.rebalance_every_ms
            sched.moves.sources_gone(set(views))
            self._readers_gone(sched, views)
            if self.config.rebalance:
                mine = sched.view(self.executor, True, self.role)
                victims = [r for r in sched.victim_order() if not sched.moves.lending.moving(r.request_id)]
                picks = balance.pick(victims, mine, views, self.config.rebalance_gap, self.block_size)
        stops = self._handoffs(sched, member, views) if self.role == PREFILL else []
        return self._move(sched, member, picks, busy, stops)

    def _handoffs(self, sched: Scheduler, member: Member, views: dict[str, PoolView] | None) -> list[balance.Move]:
        """A prefill executor's requests (core/disagg.py): each gets a decode executor; while its prompt is
        computed, each new round of full blocks is offered there (the first asking it to reserve room for
        the whole prompt); after its first token it leaves (the short stop) for that executor."""
        now, stops = now_ms(), []
        if self.config.migration != "kv":
            return []  # a handoff moves KV: without it the prefill executor decodes what it prefilled
        for req in list(sched.running):
            gone = req.handoff and views is not None and not (views.get(req.handoff) or _NOT_SERVING).serving
            if (not req.handoff or gone) and views is not None:
                req.handoff = disagg.handoff(views, self.executor, blocks_for(req.num_tokens + 1, self.block_size))
            if not req.handoff:
                continue
            if sched.handing_off(req):
                if req.output_ids and not req.num_unreported:
                    stops.append(balance.Move(req, req.handoff, "disagg"))
                continue
            reserve = blocks_for(len(req.prompt_ids), self.block_size)
            sched.moves.precopy(req, req.handoff, self.source(member), now, "disagg", reserve)
        return stops

    @staticmethod
    def _readers_gone(sched: Scheduler, views: dict[str, PoolView] | None) -> None:
        """A pre-copy whose reader no longer serves (it died, or drains) will never be read: end its lends,
        and the request makes its short stop for any executor."""
        if views is None:
            return
        for pre in list(sched.moves.lending.precopies.values()):
            if not (views.get(pre.to) or _NOT_SERVING).serving:
                pre.to = ""
                for lend_id in list(pre.lend_ids):
                    sched.moves.end_lend(lend_id)

    def _move(
        self,
        sched: Scheduler,
        member: Member,
        picks: list[balance.Move],
        busy: bool,
        stops: list[balance.Move] | None = None,
    ) -> bool:
        """Pre-copy what can be of ``picks``; short stops for the rest, for the pre-copies done and for
        ``stops`` (handoffs)."""
        kv = self.config.migration == "kv"
        now = now_ms()
        stops = list(stops or [])
        for m in picks:
            if not (kv and sched.moves.precopy(m.req, m.to, self.source(member), now, m.cause)):
                stops.append(m)
        for rid, pre in list(sched.moves.lending.copied.items()):
            req = sched.requests.get(rid)
            if req is None:
                sched.moves.lending.forget(rid)
            else:
                stops.append(balance.Move(req, pre.to, pre.cause))
        if not stops:
            return False
        if busy:
            return True  # a request leaves with nothing in flight: first take what is
        for m in stops:
            sched.moves.lending.forget(m.req.request_id)
            if kv:
                sched.moves.migrate(m.req, self.source(member), now, m.cause, m.to)
            else:
                sched.requeue(m.req)
        log.info(
            "executor %s: %d requests move to peers (%s: %s)",
            self.executor,
            len(stops),
            self.config.migration,
            ", ".join(sorted({m.cause for m in stops})),
        )
        return False
