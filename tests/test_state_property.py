"""Property test of the Redis-backed scheduler state over several executors (real redis-server).

Hypothesis drives random sequences of submits, loop steps on any executor,
cancellations, executors joining, leaving (reaped as when their step fails),
draining (their requests moved elsewhere) and loops restarting, all through
the real store, the real ``Loop`` code and the real Lua scripts. Each executor
is played by a stub that returns token 7 for every sampled sequence: it
isolates state keeping from the model. After every rule the state is read
back from Redis and checked, pool by pool: no swap block owned twice, none
leaked, free + used = total on every tier, block tables consistent with token
counts; every device block free, cached-and-evictable, or held by one or more
live requests with a reference count (the loop's) equal to its holders, and
only cached blocks or blocks of one parallel-sampling group shared; the cache's hashes, LRU and placement set agree;
and request by request: each live request is in the queue or on exactly one
executor, and a reaped executor leaves nothing behind. Half the examples run
the pipelined loop (``--async-scheduling``: a plan in flight while the loop
commits the one before; the stub's channel answers plans in order).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace

import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedserve.executor.v1 import executor_pb2 as epb
from pagedserve.members import DRAINING, Member
from pagedserve.tiers import TIERS
from scheduler_svc.core import parallel
from scheduler_svc.core.disagg import DisaggConfig
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.migration import MoveConfig
from scheduler_svc.core.prefix import prompt_hashes
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.core.spec import SpecConfig
from scheduler_svc.loops.loop import Loop
from scheduler_svc.state import schema
from scheduler_svc.state.store import RedisStore

BLOCK = 4
SIZES = [(10, 3, 5), (6, 0, 0), (14, 4, 0)]  # device, CPU, disk blocks of the executors that join, in turn
ROLES = ["mixed", "decode", "prefill"]  # ... and their --role: with the third, long prompts are disaggregated
MOVES = MoveConfig(disagg=DisaggConfig(min_prompt_tokens=8, max_prefill_queue=2))
NS = "prop"


# The lends every stub executor holds, as executor_svc/transfer.py's ``Lends`` would: (instance, lend id)
# -> (tier, block) set. A pull succeeds only if its source still lends every block it names.
LENDS: dict[tuple[str, str], set[tuple[int, int]]] = {}


class EchoExecutor:
    """Stands in for executor_svc: every sampled sequence gets token 7 (never EOS); with speculative
    drafts, the leading 7s among them are accepted (then one more 7). Lends and pulls are kept in
    ``LENDS``: a pull is reported ok only while its source lends what it reads."""

    def __init__(self, info: epb.InfoResponse) -> None:
        self.info = info

    async def Step(self, plan: epb.StepPlan, timeout: float | None = None) -> epb.StepResult:
        me = self.info.instance_id
        if plan.reset_tables:
            forget_lends(me)
        for lend_id in plan.unlends:
            LENDS.pop((me, lend_id), None)
        for lend in plan.lends:
            LENDS[(me, lend.lend_id)] = {(int(b.tier), b.block) for b in lend.blocks}
        pulls = []
        for p in plan.pulls:
            lent = LENDS.get((p.src_instance_id, p.lend_id))
            ok = lent is not None and {(int(b.tier), b.block) for b in p.src} <= lent
            ClusterState.seen["pulled" if ok else "pull_failed"] += 1
            ClusterState.seen["fetched"] += ok and p.request_id.startswith("fetch/")
            pulls.append(epb.PullResult(request_id=p.request_id, ok=ok, bytes=len(p.dst) if ok else 0))
        return epb.StepResult(
            step_id=plan.step_id,
            outputs=[
                epb.SeqOutput(request_id=s.request_id, token_id=7, more_token_ids=[7] * _leading_sevens(s))
                for s in plan.seqs
                if s.sample
            ],
            pulls=pulls,
        )

    async def Info(self, request: epb.InfoRequest, timeout: float | None = None) -> epb.InfoResponse:
        return self.info


def forget_lends(instance: str) -> None:
    for key in [k for k in LENDS if k[0] == instance]:
        del LENDS[key]


def _leading_sevens(s: epb.SeqPlan) -> int:
    n = 0
    while n < len(s.draft_token_ids) and s.draft_token_ids[n] == 7:
        n += 1
    return n


class EchoChannel:
    """The pipelined loop's channel to an ``EchoExecutor``: plans queue, results come back in order."""

    def __init__(self, executor: EchoExecutor) -> None:
        self.executor = executor
        self.plans: deque[epb.StepPlan] = deque()

    def send(self, plan: epb.StepPlan) -> float:
        self.plans.append(plan)
        return 0.0

    async def result(self) -> tuple[epb.StepResult, float]:
        return await self.executor.Step(self.plans.popleft()), 0.0

    def close(self) -> None:
        self.plans.clear()


class EchoLoop(Loop):
    """The real loop, with ``EchoChannel`` in place of the Steps stream when pipelined."""

    def _open(self):  # noqa: ANN202
        return EchoChannel(self.stub) if self.pipelined else super()._open()


class ClusterState(RuleBasedStateMachine):
    redis_url = ""
    # Over all examples: the cache, forks and speculative drafts were really exercised.
    seen = {"hits": 0, "shared": 0, "forked": 0, "accepted": 0, "pulled": 0, "pull_failed": 0, "fetched": 0}

    def __init__(self) -> None:
        super().__init__()
        self.roles = list(ROLES)  # of the executors that join, in turn (a walk may change them)
        self.aio = asyncio.new_event_loop()
        self.client = aioredis.from_url(self.redis_url, decode_responses=True)
        self.store = RedisStore(self.client, NS)
        self.keys = self.store.keys
        self.run(self._wipe())
        LENDS.clear()
        self.members: dict[str, Member] = {}
        self.loops: dict[str, Loop] = {}
        self.totals: dict[str, tuple[int, int, int]] = {}
        self.reaped: list[str] = []
        self.joined = 0
        self.next_id = 0

    async def _wipe(self) -> None:
        """A clean namespace for each example (the redis-server is shared with other tests)."""
        async for key in self.client.scan_iter(match=self.keys.prefix.replace("{", "\\{").replace("}", "\\}") + "*"):
            await self.client.delete(key)

    def run(self, coro):  # noqa: ANN001, ANN201
        return self.aio.run_until_complete(coro)

    def teardown(self) -> None:
        self.seen["hits"] += int(self.run(self.client.hget(self.keys.counters, "prefix_cache_hits")) or 0)
        self.seen["forked"] += int(self.run(self.client.hget(self.keys.counters, "forked_tokens")) or 0)
        self.seen["accepted"] += int(self.run(self.client.hget(self.keys.counters, "spec_accepted_tokens")) or 0)
        self.run(self.client.aclose())
        self.aio.close()

    def lead(self, eid: str) -> None:
        """A (new) loop takes the executor's lease and restores from Redis."""
        self.run(self.client.delete(self.keys.executor(eid).leader))
        epoch = self.run(self.store.acquire(eid, "test", 60_000))
        d, c, k = self.totals[eid]
        info = epb.InfoResponse(
            instance_id=eid,
            block_size=BLOCK,
            num_gpu_blocks=d,
            num_cpu_blocks=c,
            num_disk_blocks=k,
            max_model_len=64,
            eos_token_ids=[2],
            pipelined=self.pipelined,
            role=self.members[eid].role,
        )
        loop = EchoLoop(
            self.store,
            info,
            EchoExecutor(info),
            self.config,
            epoch,
            lambda: self.members.get(eid),
            channel=object() if self.pipelined else None,
            async_scheduling=self.pipelined,
            moves=MOVES,
        )
        loop.idle_block_ms = None
        self.run(loop.start())
        self.loops[eid] = loop

    @initialize(
        policy=st.sampled_from(["fcfs", "priority"]),
        mode=st.sampled_from(["auto", "swap", "recompute"]),
        budget=st.integers(4, 24),
        pipelined=st.booleans(),
        spec=st.sampled_from([None, "ngram", "suffix"]),
    )
    def start(self, policy: str, mode: str, budget: int, pipelined: bool, spec: str | None = None) -> None:
        self.pipelined = pipelined
        self.config = SchedulerConfig(
            max_model_len=64,
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            policy=policy,
            preemption_mode=mode,
            watermark=0.0,
            spec=SpecConfig(spec, 3, prompt_lookup_min=1, prompt_lookup_max=2) if spec else None,
        )
        self.join()

    @precondition(lambda self: self.joined < len(SIZES))
    @rule()
    def join(self) -> None:
        eid = f"exec-{self.joined}"
        self.totals[eid] = SIZES[self.joined]
        self.joined += 1
        role = self.roles[self.joined - 1]
        self.members[eid] = Member(eid, "stub", "m", "digest", "float32", BLOCK, self.totals[eid], 64, role=role)
        self.lead(eid)

    @rule(
        prompt=st.integers(1, 20),
        max_tokens=st.integers(1, 20),
        priority=st.integers(0, 3),
        salt=st.sampled_from([None, None, "tenant-a"]),
    )
    def submit(self, prompt: int, max_tokens: int, priority: int, salt: str | None) -> None:
        """Prompts share prefixes (3, 4, 5, ...), so the prefix cache is hit, shared and evicted."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(
            rid,
            list(range(3, 3 + prompt)),
            Params(max_tokens=max_tokens, temperature=0.0),
            priority=priority,
            cache_salt=salt,
        )
        hashes = prompt_hashes(req.prompt_ids, salt, BLOCK)  # as the frontends do: placement sees who caches it
        self.run(self.store.submit(req, [], self.config.policy, hashes=hashes))

    @rule(n=st.integers(2, 4), prompt=st.integers(1, 14), max_tokens=st.integers(1, 12))
    def submit_group(self, n: int, prompt: int, max_tokens: int) -> None:
        """A request with sampling.n: its completions are queued together, claimed together, and fork
        the prompt (shared full blocks, a copied partial one)."""
        gid = f"g{self.next_id}"
        self.next_id += 1
        req = Request(gid, list(range(3, 3 + prompt)), Params(max_tokens=max_tokens, temperature=0.0, n=n))
        self.run(self.store.admit_group(parallel.completions(req), [], self.config.policy))

    @precondition(lambda self: bool(self.loops))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        eid = data.draw(st.sampled_from(sorted(self.loops)))
        assert self.run(self.loops[eid].iterate())

    @precondition(lambda self: bool(self.loops))
    @rule(data=st.data(), prompt=st.integers(9, 20))
    def resend(self, data: st.DataObject, prompt: int) -> None:
        """A prompt sent, served, then sent again: the second time its full blocks are cached
        (unless evicted meanwhile), so every run exercises hits and sharing, not only by chance."""
        self.submit(prompt, 2, 0, None)
        self.run_a_while(data, 6)
        self.submit(prompt, 2, 0, None)
        self.submit(prompt, 2, 0, None)

    @precondition(lambda self: bool(self.loops))
    @rule(data=st.data(), steps=st.integers(2, 12))
    def run_a_while(self, data: st.DataObject, steps: int) -> None:
        """Several steps of one executor: requests finish, their cached blocks are hit, shared, evicted."""
        eid = data.draw(st.sampled_from(sorted(self.loops)))
        for _ in range(steps):
            assert self.run(self.loops[eid].iterate())

    @rule(data=st.data(), reason=st.sampled_from([Finish.ABORT, Finish.STOP]))
    def cancel(self, data: st.DataObject, reason: Finish) -> None:
        live = sorted(self.run(self.client.smembers(self.keys.live)))
        if live:
            assert self.run(self.store.cancel(data.draw(st.sampled_from(live)), reason))

    @precondition(lambda self: bool(self.loops))
    @rule(data=st.data())
    def loop_restarts(self, data: st.DataObject) -> None:
        """A new leader rebuilds the executor's scheduler from Redis alone (and applies cancellations
        its predecessor had not read yet)."""
        eid = data.draw(st.sampled_from(sorted(self.loops)))
        pipe, held = self.loops[eid].s.pipe, self.loops[eid].s.sched.requests
        in_flight, synced, moving = bool(pipe), pipe.can_commit(), self.loops[eid].s.moving
        before = _state(self.loops[eid])
        cancelled = {rid for rid in before if self.run(self.client.hget(self.keys.req(rid), "cancel"))}
        # A cancelled completion hands its prompt blocks to a mate still waiting to fork from it.
        groups = {held[rid].group for rid in cancelled} - {""}
        handed = {rid for rid, r in held.items() if r.group in groups}
        # Placed but not admitted (asking a peer for its prefix, or waiting with a fetched one): a new
        # leader sends it back to the queue, as it does any request it loads waiting.
        cancelled |= {rid for rid, v in before.items() if v[0] == Status.WAITING}
        self.lead(eid)
        after = _state(self.loops[eid])
        if not synced:
            pass  # a deferred commit: the reload goes back to the last one (the invariants check it)
        elif moving:  # Redis records the swaps of a plan the restart dropped unrun: the pool resets, all recompute
            queued = {schema.request_id_of(k) for k in self.run(self.client.zrange(self.keys.queue, 0, -1))}
            assert set(before) - cancelled <= queued | set(after)
            assert all(v[0] != Status.SWAPPED for v in after.values())
        elif in_flight:  # it goes back to what reported steps computed: the same requests
            assert set(after) == set(before) - cancelled
        else:
            assert {rid: v for rid, v in after.items() if rid not in handed} == {
                rid: v for rid, v in before.items() if rid not in cancelled | handed
            }
            assert set(after) == set(before) - cancelled

    @precondition(lambda self: bool(self.loops))
    @rule(data=st.data())
    def executor_lost(self, data: st.DataObject) -> None:
        eid = data.draw(st.sampled_from(sorted(self.loops)))
        held = set(self.loops[eid].s.sched.requests)
        self.run(self.store.reap(eid))
        forget_lends(eid)
        del self.loops[eid], self.members[eid]
        self.reaped.append(eid)
        queued = {schema.request_id_of(k) for k in self.run(self.client.zrange(self.keys.queue, 0, -1))}
        live = self.run(self.client.smembers(self.keys.live))
        assert held & live <= queued, "the lost executor's unfinished requests are back in the queue"

    @precondition(lambda self: bool(self.loops))
    @rule(data=st.data())
    def executor_drains(self, data: st.DataObject) -> None:
        """Draining past its deadline: the next step moves everything to the queue; it takes nothing new."""
        eid = data.draw(st.sampled_from(sorted(self.loops)))
        self.members[eid] = replace(self.members[eid], state=DRAINING, evacuate_at_ms=1)
        self.run(self.client.hset(self.keys.member(eid), "state", DRAINING))
        # Requests leave with nothing in flight: pipelined, the plans in flight are taken first.
        for _ in range(3 if self.pipelined else 1):
            self.run(self.loops[eid].iterate())
        assert not self.loops[eid].s.sched.requests
        assert not self.run(self.client.smembers(self.keys.executor(eid).live))
        self._leaves(eid)  # it exits at once, its lends with it: pulls from them fail, and recompute

    @precondition(lambda self: any(m.state != DRAINING for m in self.members.values()))
    @rule(data=st.data())
    def executor_starts_draining(self, data: st.DataObject) -> None:
        """Draining before any deadline: what a serving peer has room for moves with its KV (lent here,
        pulled there); the rest stays."""
        eid = data.draw(st.sampled_from(sorted(e for e, m in self.members.items() if m.state != DRAINING)))
        self.members[eid] = replace(self.members[eid], state=DRAINING, evacuate_at_ms=0)
        self.run(self.client.hset(self.keys.member(eid), "state", DRAINING))

    @precondition(
        lambda self: any(
            m.state == DRAINING and not self.loops[e].s.sched.requests and not self.loops[e].s.sched.moves.lending
            for e, m in self.members.items()
        )
    )
    @rule(data=st.data())
    def drained_executor_leaves(self, data: st.DataObject) -> None:
        done = [
            e
            for e, m in self.members.items()
            if m.state == DRAINING and not self.loops[e].s.sched.requests and not self.loops[e].s.sched.moves.lending
        ]
        self._leaves(data.draw(st.sampled_from(sorted(done))))

    def _leaves(self, eid: str) -> None:
        self.run(self.store.reap(eid))  # it exits; the membership record expires
        forget_lends(eid)
        del self.loops[eid], self.members[eid]
        self.reaped.append(eid)

    @invariant()
    def redis_state_is_consistent(self) -> None:
        if not hasattr(self, "config"):
            return
        queued = {schema.request_id_of(k) for k in self.run(self.client.zrange(self.keys.queue, 0, -1))}
        placed: dict[str, str] = {}
        for eid, loop in self.loops.items():
            snap = self.run(self.store.load(eid))
            # Pipelined, a plan that moves KV (swaps, a fork's copy) in flight with another defers the commit of
            # its own turn (the result's part went alone): Redis holds the last commit (and claims since), the
            # loop is ahead of it.
            synced = loop.s.pipe.can_commit()
            # Placed but not running: waiting for a peer's offer, or for room with its fetched prefix.
            held = {*loop.s.sched.moves.asking, *(r.request_id for r in loop.s.sched.waiting)}
            _check_pool(snap, self.totals[eid], self.pipelined, synced, held)
            _check_cache(snap, loop if synced else None, self.run(self.client.smembers(self.keys.executor(eid).hashes)))
            for r, _ in snap.requests:
                assert r.request_id not in placed and r.request_id not in queued, f"{r.request_id} is in two places"
                placed[r.request_id] = eid
            if synced:
                assert {r.request_id for r, _ in snap.requests} == set(loop.s.sched.requests)
        live = self.run(self.client.smembers(self.keys.live))
        assert live == queued | set(placed), "every live request is queued or placed, and nothing else is"
        for rid in queued:
            fields = self.run(self.client.hgetall(self.keys.req(rid)))
            assert fields["status"] == Status.WAITING and fields["executor"] == "", (rid, fields)
        for rid, eid in placed.items():
            assert self.run(self.client.hget(self.keys.req(rid), "executor")) == eid
        for eid in self.reaped:
            assert not any(self.run(self.client.exists(k)) for k in self.keys.executor(eid).all()), f"{eid} left state"


def _state(loop: Loop) -> dict:
    return {
        r.request_id: (r.status, r.num_computed, list(r.blocks), list(r.swap_blocks), list(r.output_ids))
        for r in loop.s.sched.requests.values()
    }


def _check_cache(snap, loop: Loop | None, hashes: set[str]) -> None:  # noqa: ANN001
    """Reference counts: each device block's count in the loop equals its holders in Redis (``loop``
    None: the loop is ahead of Redis, only Redis is checked); a block held twice is cached, or held
    by mates of one parallel-sampling group; the LRU holds exactly the cached blocks nobody holds;
    the placement set holds exactly the cached hashes."""
    lent = [b for t, b in snap.lent if t == 0]
    holders = [0] * (len(snap.free[0]) + sum(len(r.blocks) for r, _ in snap.requests) + len(lent))
    groups: list[set[str]] = [set() for _ in holders]
    for b in lent:  # a lend holds its device blocks as one more holder
        holders[b] += 1
        groups[b].add("lend")
    for r, _ in snap.requests:
        assert len(set(r.blocks)) == len(r.blocks), f"{r.request_id} holds a block twice"
        for b in r.blocks:
            holders[b] += 1
            groups[b].add(r.group or r.request_id)
    if loop is not None:
        holders = holders[: len(loop.s.sched.blocks.refs)]
        assert loop.s.sched.blocks.refs == holders, "reference counts equal holders"
    ClusterState.seen["shared"] += any(n > 1 for n in holders)
    for b, n in enumerate(holders):
        assert n <= 1 or b in snap.cache or len(groups[b]) == 1, f"device block {b} is shared but not cached"
    free = set(snap.free[0])
    assert set(snap.ranks) == {b for b in snap.cache if b in free}, "evictable = cached and held by nobody"
    assert len(set(snap.cache.values())) == len(snap.cache), "a hash names one block"
    assert hashes == {h.hex() for h in snap.cache.values()}, "placement's set is the cache's hashes"
    if loop is not None:
        bm = loop.s.sched.blocks
        assert {b: h for b, h in bm.hash_of.items()} == snap.cache and dict(bm.lru) == snap.ranks


def _check_pool(
    snap,
    totals: tuple[int, int, int],
    pipelined: bool = False,  # noqa: ANN001
    synced: bool = True,
    held: set[str] | None = None,
) -> None:
    """``pipelined``: a commit may hold a launched plan's allocations (blocks for tokens not computed
    yet, which a reload keeps) beside what reported steps computed; ``synced`` False: the commit is
    deferred, and requests claimed since are placed but still waiting."""
    owned: list[list[int]] = [[], [], []]
    for tier, b in snap.lent:  # blocks of requests that left with their KV, until their reader is done
        owned[tier].append(b)
    for r, _ in snap.requests:
        owned[0] += r.blocks
        for tier, b in r.swap_blocks:
            owned[tier].append(b)
        if r.status == Status.RUNNING:
            needed = blocks_for(r.num_computed, BLOCK)
            # Ahead of what is computed only by a launched plan's allocations (pipelined), or by the blocks
            # a pull filled (or failed to: then they are recomputed) for tokens the request already has.
            most = max(needed, blocks_for(r.num_tokens, BLOCK))
            assert needed <= len(r.blocks) if pipelined else needed <= len(r.blocks) <= most, r
            assert not r.swap_blocks
        elif r.status == Status.WAITING and (not synced or r.request_id in (held or ())):
            assert not r.blocks and not r.swap_blocks, r
            continue
        else:
            assert r.status == Status.SWAPPED, f"{r.request_id} is {r.status} while placed"
            assert len(r.swap_blocks) == blocks_for(r.num_computed, BLOCK) and not r.blocks, r
        assert r.num_computed <= r.num_tokens
        assert len(r.output_ids) <= r.params.max_tokens
    owned[0] = sorted(set(owned[0]))  # device blocks may be shared (_check_cache checks how)
    for tier in TIERS:
        assert len(owned[tier]) == len(set(owned[tier])), f"tier {tier}: a block is owned twice"
        assert not set(owned[tier]) & set(snap.free[tier]), f"tier {tier}: an owned block is free"
        assert len(owned[tier]) + len(snap.free[tier]) == totals[tier], f"tier {tier}: blocks leaked"


def _walk_to_sharing() -> dict[str, int]:
    """A fixed walk through the rules that reaches a prefix-cache hit, a shared block and a fork by
    construction (the invariants checked after every step), so the coverage the test asserts never
    depends on how lucky Hypothesis's exploration was."""
    before = dict(ClusterState.seen)
    machine = ClusterState()
    try:
        machine.start("fcfs", "recompute", 24, False)
        loop = machine.loops["exec-0"]

        def steps(n: int) -> None:
            for _ in range(n):
                assert machine.run(loop.iterate())
                machine.redis_state_is_consistent()

        machine.submit(9, 2, 0, None)  # two full blocks of 4, cached when it finishes
        steps(2)
        machine.submit(9, 2, 0, None)  # the same prompt: its full blocks are hits
        steps(1)
        machine.submit_group(2, 9, 3)  # two completions fork the prompt: shared blocks, forked tokens
        steps(30)
    finally:
        machine.teardown()
    return {k: ClusterState.seen[k] - before[k] for k in before}


def _walk_to_migration() -> dict[str, int]:
    """A fixed walk that moves requests with their KV by construction: exec-0 drains with requests
    running, exec-1 pulls them (ok), exec-0's lends end; then exec-1 drains past its deadline and
    leaves at once, so a third executor's pulls of its lends fail and recompute."""
    before = dict(ClusterState.seen)
    machine = ClusterState()
    machine.roles = ["mixed", "mixed", "decode"]  # a prefill executor is never a move's destination
    try:
        machine.start("fcfs", "recompute", 24, False)
        machine.join()

        def steps(eid: str, n: int) -> None:
            for _ in range(n):
                assert machine.run(machine.loops[eid].iterate())
                machine.redis_state_is_consistent()

        for _ in range(2):
            machine.submit(9, 12, 0, None)
        steps("exec-0", 3)  # both claimed and decoding on exec-0
        machine.executor_starts_draining(data=_Drawn("exec-0"))
        steps("exec-0", 1)  # lends their full blocks (pre-copy) and offers them to exec-1; they decode on
        source = machine.loops["exec-0"].s.sched
        assert source.moves.lending.precopies and source.requests
        for _ in range(12):  # exec-1 fetches the full blocks; exec-0 lends the rest and requeues them for
            steps("exec-1", 1)  # exec-1, which claims them, pulls the rest, decodes; exec-0's lends end
            steps("exec-0", 1)
            if not source.requests and not source.moves.lending:
                break
        assert not source.requests and not source.moves.lending
        machine.drained_executor_leaves(data=_Drawn("exec-0"))
        machine.join()
        machine.executor_drains(data=_Drawn("exec-1"))  # lends to exec-2, then leaves at once
        steps("exec-2", 20)
    finally:
        machine.teardown()
    return {k: ClusterState.seen[k] - before[k] for k in before}


def _walk_to_peer_prefix() -> dict[str, int]:
    """A fixed walk where a request's prefix comes from a peer's cache by construction: exec-0 computes a
    prompt and caches its blocks, then drains (so placement gives the same prompt to exec-1), exec-1 asks
    exec-0 for the cached blocks, exec-0 lends them, exec-1 fetches them and computes only the rest."""
    before = dict(ClusterState.seen)
    machine = ClusterState()
    try:
        machine.start("fcfs", "recompute", 24, False)
        machine.join()

        def steps(eid: str, n: int) -> None:
            for _ in range(n):
                assert machine.run(machine.loops[eid].iterate())
                machine.redis_state_is_consistent()

        machine.submit(13, 1, 0, None)  # three full blocks of 4, cached on exec-0 when it finishes
        steps("exec-0", 3)
        holder, reader = machine.loops["exec-0"].s.sched, machine.loops["exec-1"].s.sched
        assert not holder.requests and holder.blocks.cached
        machine.executor_starts_draining(data=_Drawn("exec-0"))
        steps("exec-0", 1)  # publishes its view: not serving
        machine.submit(13, 2, 0, None)
        steps("exec-1", 1)  # claims it; exec-0 caches more of its prompt: it asks exec-0
        assert reader.moves.asking
        steps("exec-0", 1)  # lends the cached blocks, offers them to exec-1
        assert holder.moves.lending.lends
        for _ in range(4):  # fetches them, admits the request with them as its prefix hit, decodes
            steps("exec-1", 1)
        steps("exec-0", 1)  # reads the unlend doorbell: its lend ends
        assert not holder.moves.lending.lends and not reader.requests
        assert reader.counters.prefix_blocks == 3 and reader.counters.prefix_cache_hits == 12
    finally:
        machine.teardown()
    return {k: ClusterState.seen[k] - before[k] for k in before}


def _walk_to_handoff() -> dict[str, int]:
    """A fixed walk where a prompt is disaggregated by construction: a decode executor and a prefill one;
    a 13-token prompt (over the 8 of ``MOVES``) goes to the prefill executor, which computes it 4 tokens a
    step and offers each chunk's full blocks to the decode executor (reserving room for the whole prompt
    first); after the first token it hands the request over, and the decode executor pulls the rest."""
    before = dict(ClusterState.seen)
    machine = ClusterState()
    machine.roles = ["decode", "prefill"]
    try:
        machine.start("fcfs", "recompute", 4, False)
        machine.join()
        decode, prefill = machine.loops["exec-0"], machine.loops["exec-1"]
        for loop in (decode, prefill):  # both publish their views
            assert machine.run(loop.iterate())
        machine.submit(13, 5, 0, None)
        for _ in range(16):
            for loop in (prefill, decode):
                assert machine.run(loop.iterate())
                machine.redis_state_is_consistent()
            if not decode.s.sched.requests and not prefill.s.sched.requests and decode.s.sched.counters.finished:
                break
        assert prefill.s.sched.counters.migrations_disagg == 1, "handed over after its first token"
        assert decode.s.sched.counters.handoff_blocks >= 2, "rounds of the prompt came while it was computed"
        assert decode.s.sched.counters.finished == 1 and decode.s.sched.counters.migrations_in == 1
    finally:
        machine.teardown()
    return {k: ClusterState.seen[k] - before[k] for k in before}


def _walk_to_acceptance() -> dict[str, int]:
    """A fixed walk where speculative drafts are accepted by construction: the echo executor samples 7
    every time, so once a request's output holds a 7, the ngram proposer drafts 7s and they match."""
    before = dict(ClusterState.seen)
    machine = ClusterState()
    try:
        machine.start("fcfs", "recompute", 24, False, spec="ngram")
        machine.submit(3, 16, 0, None)
        for _ in range(12):
            assert machine.run(machine.loops["exec-0"].iterate())
            machine.redis_state_is_consistent()
    finally:
        machine.teardown()
    return {k: ClusterState.seen[k] - before[k] for k in before}


def test_redis_state_machine(redis_url: str) -> None:
    ClusterState.redis_url = redis_url
    walked = _walk_to_sharing()
    assert min(v for k, v in walked.items() if k not in ("accepted", "pulled", "pull_failed", "fetched")) > 0, walked
    moved = _walk_to_migration()
    assert moved["pulled"] > 0 and moved["pull_failed"] > 0 and moved["fetched"] > 0, moved
    assert _walk_to_peer_prefix()["fetched"] == 1
    assert _walk_to_handoff()["fetched"] >= 2
    assert _walk_to_acceptance()["accepted"] > 0
    run = ClusterState.TestCase
    run.settings = settings(
        max_examples=60,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same exploration on every machine and run: a red suite is never a lucky draw
    )
    run().runTest()
    assert min(ClusterState.seen.values()) > 0, ClusterState.seen  # the walks above reach each, at least


class _Drawn:
    """What ``data.draw`` returned, in order, in an example Hypothesis found."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object) -> object:
        return self.values.pop(0)


def test_a_restarted_pipelined_loop_restores_a_resent_prompts_computed_tokens(redis_url: str) -> None:
    """Hypothesis's shrunk example (found 2026-12-02), replayed step by step: a prefill chunk that
    samples nothing, whose request is in no later plan, must still commit what it computed (a
    pipelined commit had written only the chunk's start, 4 where the request held 10)."""
    ClusterState.redis_url = redis_url
    machine = ClusterState()
    try:
        machine.start(policy="fcfs", mode="swap", budget=5, pipelined=True)
        machine.redis_state_is_consistent()
        machine.submit_group(max_tokens=12, n=2, prompt=1)
        machine.resend(data=_Drawn("exec-0"), prompt=13)
        machine.join()
        machine.resend(data=_Drawn("exec-1"), prompt=9)
        machine.redis_state_is_consistent()
        machine.loop_restarts(data=_Drawn("exec-1"))
    finally:
        machine.teardown()
