"""Continuous batching under a token budget, with preemption by swap or recompute (which one:
``core/preemption.py``).

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
from dataclasses import dataclass

from scheduler_svc.core import group, lora, preemption
from scheduler_svc.core.blocks import (
    DEVICE,
    DISK,
    TIERS,
    BlockManager,
)
from scheduler_svc.core.deadline import expired_among
from scheduler_svc.core.fit import blocks_for, fits_ever
from scheduler_svc.core.logprob import Logprob
from scheduler_svc.core.migration import (
    PullPlan,
    pull_for,
)
from scheduler_svc.core.output import Scheduled, SchedulerOutput
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.queue import make_queue
from scheduler_svc.core.record import Counters, StepRecord
from scheduler_svc.core.request import Finish, Request, Status
from scheduler_svc.core.spec import SpecConfig, Speculator
from scheduler_svc.core.transfers import ASK_TIMEOUT_MS, Source, Transfers  # noqa: F401 (re-exported)

PREEMPTION_MODES = preemption.MODES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    preemption_mode: str = "auto"  # --preemption-mode (core/preemption.py)
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
        self.watermark = int(config.watermark * blocks.total(DEVICE))  # device blocks admission keeps free
        self.spec = Speculator.of(config.spec) if config.spec is not None else None
        self._k = 0  # this step's draft length (``DraftPolicy``)
        self._spec_accepted = self._spec_rejections = 0  # drafts accepted and rows cut short, this update
        self._spec_asked = self._spec_proposed = 0  # rows drafts were asked for, and got some, this step
        self.moves = Transfers(self)  # KV that moves between executors (core/transfers.py)

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
        self.moves.lending.forget(req.request_id)
        self.moves.drop_fetch(req.request_id)
        if self.moves.asking.pop(req.request_id, None) is not None:
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
        self.count("finished")
        return req

    def expire(self, now_ms: int) -> list[Request]:
        """Finish (``deadline``) the waiting and swapped requests whose queue deadline passed
        before they started; their blocks, swapped ones included, are freed."""
        gone = expired_among([*self.waiting, *self.swapped, *(r for r, _ in self.moves.asking.values())], now_ms)
        for req in gone:
            self.finish(req.request_id, Finish.DEADLINE)
        return gone

    def requeue(self, req: Request) -> None:
        """``req`` leaves this executor for the shared queue, holding nothing: recomputed wherever it runs next
        (unless it left with its KV lent: ``migrate``)."""
        if req.kv is None or req.kv.lend not in self.moves.lending.lends:
            self.count("moved_recomputed_tokens", req.num_computed)  # KV it loses by leaving
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
            f = self.moves.fetches.get(req.request_id)
            if f is None or not f.pulled or now_ms is None:
                self.requeue(req)
                continue
            f.hold_ms = f.hold_ms or now_ms + ASK_TIMEOUT_MS
            if now_ms >= f.hold_ms:
                self.requeue(req)

    def evacuate(self) -> None:
        """BlockMove every request elsewhere (the executor is draining and out of time)."""
        for req in [*self.running, *self.swapped, *self.waiting, *(r for r, _ in self.moves.asking.values())]:
            self.requeue(req)

    def take_record(self) -> StepRecord:
        rec, self.record = self.record, StepRecord()
        rec.changed = self.blocks.take_changes()
        rec.cache = self.blocks.cache_delta(rec.changed[0])
        return rec

    def count(self, name: str, n: int = 1) -> None:
        setattr(self.counters, name, getattr(self.counters, name) + n)
        setattr(self.record.counters, name, getattr(self.record.counters, name) + n)

    @property
    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting) or len(self.swapped) or self.moves.pending)

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
        victim.pulling = False  # a pull in flight for it no longer counts (``Transfers.pulled``)
        mode = self.config.preemption_mode
        if not recompute and victim.num_computed > 0 and preemption.swaps(mode, victim, self.blocks, self.moves.costs):
            moves = self.blocks.swap_out(victim)
            out.swap_out.extend(moves)
            self.count("preemptions_swap")
            self.count("swapped_out_blocks", len(moves))
            self.count("disk_spilled_blocks", sum(m.dst_tier == DISK for m in moves))
            victim.status = Status.SWAPPED
            self.swapped.prepend(victim)
        else:
            self.blocks.free(victim)
            victim.num_computed = 0
            self.count("preemptions_recompute")
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

    def observe_step(self, out: SchedulerOutput, step_ms: float, wait_ms: float) -> None:
        """The executor's time for a reported plan and its wait for it, for the draft length's cost model
        (``StepCost``): only plans whose rows all decode (a prompt chunk's cost is another matter)."""
        if self.spec is None or not out.scheduled:
            return
        if all(s.samples and s.num_tokens - len(s.drafts) == 1 for s in out.scheduled):
            drafts = [len(s.drafts) for s in out.scheduled]
            self.spec.policy.stepped(drafts, out.num_tokens - sum(drafts), step_ms, wait_ms)

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
        self._spec_asked += 1
        self._spec_proposed += bool(drafts)
        free = self.blocks.num_free(DEVICE) - self.watermark
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
        self.count("forked_tokens", upto)
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
            self.count("forked_tokens", upto)
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
        reserve = (self.watermark if self.running else 0) + group.fork_need(req, mates, self.blocks.block_size)
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
            reserve = self.watermark if self.running else 0
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
                self.count("swapped_in_blocks", len(moves))
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
        self.moves.drop_fetch(req.request_id)  # its hit holds what was fetched for it
        if self.blocks.caching:
            self.count("prefix_cache_queries", req.num_tokens)
            self.count("prefix_cache_hits", req.num_computed)
        if not req.output_ids:
            req.num_cached = req.num_computed

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.moves.plan(out)
        self._choose_k()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit(out, budget)
        if out.has_work:
            self.count("steps")
        if self.spec is not None:
            self.spec.policy.observe_proposals(self._spec_proposed, self._spec_asked)
            self._spec_asked = self._spec_proposed = 0
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
        self.moves.pulled(out.pulls, pulled or {})
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
        self.count("generated_tokens", generated)
        if self.spec is not None:
            self.spec.policy.observe(self._spec_accepted, self._spec_rejections)
            self._spec_accepted = self._spec_rejections = 0
        return finished

    def _accept(self, req: Request, s: Scheduled, accepted: int) -> None:
        """A row with drafts came back with ``accepted`` of them: only those count as computed, and
        blocks reserved for rejected positions past the next token's are freed."""
        if req.num_computed == s.end:  # else it was preempted or restarted since (nothing of this step counts)
            req.num_computed = s.end + accepted
            self.blocks.trim(req, req.num_computed + 1)
        self.count("spec_drafts")
        self.count("spec_draft_tokens", len(s.drafts))
        self.count("spec_accepted_tokens", accepted)
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
            watermark=self.watermark,
            held=dict(held),
            max_loras=self.config.max_loras,
            adapters=tuple(sorted(lora.adapters_of([*self.running, *self.swapped]))) if self.config.max_loras else (),
            role=role,
        )
