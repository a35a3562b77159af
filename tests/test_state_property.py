"""Property test of the Redis-backed scheduler state (real redis-server).

Hypothesis drives random submit / step / abort / stop / restart sequences
through the real store and the loop's own intake and restore code; the
executor is played by a function that returns token 7 for every sampled
sequence (it isolates state keeping from the model). After every commit the
state is read back from Redis and checked: no block owned twice, none leaked,
free + used = total on the device, CPU and disk pools, and block tables
consistent with token counts.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.core.blocks import TIERS, blocks_needed
from scheduler_svc.core.request import Params, Request, Status
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.loop import Loop
from scheduler_svc.store import Commit, RedisStore
from pagedserve.executor.v1 import executor_pb2 as epb

BLOCK = 4
TOTALS = (10, 3, 5)


class SchedulerState(RuleBasedStateMachine):
    redis_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.aio = asyncio.new_event_loop()
        self.client = aioredis.from_url(self.redis_url, decode_responses=True)
        self.store = RedisStore(self.client, "prop")
        self.run(self.client.flushdb())
        self.info = epb.InfoResponse(block_size=BLOCK, num_gpu_blocks=TOTALS[0], num_cpu_blocks=TOTALS[1],
                                     num_disk_blocks=TOTALS[2], max_model_len=64, eos_token_ids=[2],
                                     instance_id="exec-1")
        self.epoch = 0
        self.next_id = 0
        self.cursor = "0-0"

    def run(self, coro):  # noqa: ANN001, ANN201
        return self.aio.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.client.aclose())
        self.aio.close()

    @initialize(policy=st.sampled_from(["fcfs", "priority"]), mode=st.sampled_from(["swap", "recompute"]),
                budget=st.integers(4, 24))
    def start(self, policy: str, mode: str, budget: int) -> None:
        config = SchedulerConfig(max_model_len=64, max_num_seqs=6, max_num_batched_tokens=budget, policy=policy,
                                 preemption_mode=mode, watermark=0.0)
        self.loop = Loop(self.store, executor=None, config=config, replica="test")  # type: ignore[arg-type]
        self.restart()

    def restart(self) -> None:
        self.epoch = self.run(self.store.acquire("test", 60_000)) or self.epoch
        self.sched, self.cursor = self.run(self.loop._restore(self.info, self.epoch))

    def commit(self, c: Commit) -> None:
        self.run(self.store.apply(self.epoch, self.store.commit_ops(c)))

    def intake(self) -> None:
        items = self.run(self.store.read_incoming(self.cursor, None))
        c = Commit(blocks=self.sched.blocks)
        if items:
            self.run(self.loop._intake(self.sched, items, c))
            self.cursor = c.cursor = items[-1].stream_id
        self.commit(c)

    @rule(prompt=st.integers(1, 20), max_tokens=st.integers(1, 20), priority=st.integers(0, 3))
    def submit(self, prompt: int, max_tokens: int, priority: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(rid, list(range(3, 3 + prompt)), Params(max_tokens=max_tokens, temperature=0.0),
                      priority=priority)
        self.run(self.store.submit(req, []))
        self.intake()

    @rule()
    def step(self) -> None:
        out = self.sched.schedule()
        c = Commit(blocks=self.sched.blocks)
        c.record_step(self.sched, out, {x.req.request_id: 7 for x in out.scheduled if x.samples})
        c.record_totals(self.sched)
        self.commit(c)

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data(), op=st.sampled_from(["abort", "stop"]))
    def end(self, data: st.DataObject, op: str) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.run(self.store.send(op, rid))
        self.intake()

    @rule()
    def scheduler_restarts(self) -> None:
        """A new leader rebuilds everything from Redis alone."""
        before = {r.request_id: (r.status, r.num_computed, list(r.blocks), list(r.swap_blocks), list(r.output_ids))
                  for r in self.sched.requests.values()}
        self.restart()
        after = {r.request_id: (r.status, r.num_computed, list(r.blocks), list(r.swap_blocks), list(r.output_ids))
                 for r in self.sched.requests.values()}
        assert after == before

    @invariant()
    def redis_state_is_consistent(self) -> None:
        if not hasattr(self, "sched"):
            return
        snap = self.run(self.store.load())
        owned: list[list[int]] = [[], [], []]
        for r in snap.requests:
            owned[0] += r.blocks
            for tier, b in r.swap_blocks:
                owned[tier].append(b)
            if r.status == Status.RUNNING:
                assert len(r.blocks) == blocks_needed(r.num_computed, BLOCK), r
                assert not r.swap_blocks
            elif r.status == Status.SWAPPED:
                assert len(r.swap_blocks) == blocks_needed(r.num_computed, BLOCK) and not r.blocks, r
            else:
                assert r.status == Status.WAITING and not r.blocks and not r.swap_blocks, r
            assert r.num_computed <= r.num_tokens
            assert len(r.output_ids) <= r.params.max_tokens
        for tier in TIERS:
            assert len(owned[tier]) == len(set(owned[tier])), f"tier {tier}: a block is owned twice"
            assert not set(owned[tier]) & set(snap.free[tier]), f"tier {tier}: an owned block is free"
            assert len(owned[tier]) + len(snap.free[tier]) == TOTALS[tier], f"tier {tier}: blocks leaked"
        assert {r.request_id for r in snap.requests} == set(self.sched.requests)


def test_redis_state_machine(redis_url: str) -> None:
    SchedulerState.redis_url = redis_url
    run = SchedulerState.TestCase
    run.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                            suppress_health_check=list(HealthCheck))
    run().runTest()
