"""The pipelined loop's one-step-ahead bookkeeping on plain data: no Redis, no gRPC, no model.

``Markov`` plays the executor: it runs plans in the order they were sent, resolves
``from_last_sample`` from its own last samples, and samples a token that depends only
on the step's last input token and its position (EOS now and then), so that a serial
run and a pipelined run of the same requests must produce the same tokens.
"""

from __future__ import annotations

from collections import deque

import pytest

from executor_svc.runner import LastSampled, UnknownSample
from pagedserve.keys import Keys
from pagedserve.tiers import BlockMove
from scheduler_svc.core.blocks import CPU, DEVICE
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.output import SchedulerOutput
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.loops.flights import Flight, Pipeline
from scheduler_svc.loops.plan import PlanBuilder
from scheduler_svc.state.commit import CommitWriter
from tests.unit.scheduler_svc.core.test_scheduler import EOS, check_blocks, make, req


class Markov:
    """An executor stand-in: token = f(last input token, position); EOS where f says so."""

    def __init__(self, eos_every: int = 0) -> None:
        self.sampled = LastSampled()
        self.eos_every = eos_every

    def token(self, last: int, pos: int) -> int:
        t = (last * 31 + pos * 17) % 97 + 10
        return EOS if self.eos_every and t % self.eos_every == 0 else t

    def run(self, plan) -> dict[str, int]:  # type: ignore[no-untyped-def]
        seqs = [
            type(
                "Seq",
                (),
                {"request_id": s.request_id, "token_ids": list(s.token_ids), "from_last_sample": s.from_last_sample},
            )()
            for s in plan.seqs
        ]
        self.sampled.resolve(seqs)
        for rid in plan.forget:
            self.sampled.forget(rid)
        out = {
            p.request_id: self.token(s.token_ids[-1], p.start_pos + len(s.token_ids))
            for p, s in zip(plan.seqs, seqs)
            if p.sample
        }
        self.sampled.record(list(out.items()))
        return out


def drive(s: Scheduler, depth: int, executor: Markov, abort_at: dict[int, str] | None = None) -> list[int]:
    """Run ``s`` to the end as the loop does with ``depth`` plans in flight; returns how many were in
    flight at each commit point, after checking what a commit there would store."""
    pipe, plans, ended = Pipeline(depth), PlanBuilder(), []
    in_flight_at_commit: list[int] = []
    step = 0
    while s.has_work or pipe:
        if abort_at and step in abort_at:
            s.finish(abort_at.pop(step), Finish.ABORT)
        done = pipe.wait_first()
        if done:
            take(s, pipe, executor, ended)
        launched = False
        if pipe.can_launch() and s.has_work:
            launched, step, ended = launch(s, pipe, plans, step, ended)
        if not done and pipe.wait_after(launched):
            take(s, pipe, executor, ended)
            if pipe.launch_again(launched) and pipe.can_launch() and s.has_work:  # before the commit, as the loop
                launched, step, ended = launch(s, pipe, plans, step, ended)
        if pipe.can_commit():
            in_flight_at_commit.append(len(pipe))
            stored = pipe.starts()
            for r in s.requests.values():  # what the commit would store: computed for sure, with its blocks
                computed = stored.get(r.request_id, r.num_computed)
                assert computed <= r.num_known
                if r.status == Status.RUNNING:
                    assert blocks_for(computed, s.blocks.block_size) <= len(r.blocks)
        check_blocks(s)
    return in_flight_at_commit


flight_plans: deque = deque()


def launch(
    s: Scheduler, pipe: Pipeline, plans: PlanBuilder, step: int, ended: list[str]
) -> tuple[bool, int, list[str]]:
    """Schedule, build and send a plan (if there is work): (launched, the next step id, ended still to send)."""
    out = s.schedule()
    if not out.has_work:
        return False, step, ended
    flight_plans.append(plans.build(out, step, ended))
    s.launch(out)
    pipe.flights.append(Flight.of(out, step))
    return True, step + 1, []


def take(s: Scheduler, pipe: Pipeline, executor: Markov, ended: list[str]) -> None:
    """The oldest plan's result: the executor runs plans in the order they were sent."""
    flight = pipe.flights.popleft()
    result = executor.run(flight_plans.popleft())
    ended += [r.request_id for r in s.update(flight.out, result)]


@pytest.fixture(autouse=True)
def _fresh_plans() -> None:
    flight_plans.clear()


def outputs(
    mode: str, depth: int, blocks: int, eos_every: int = 0
) -> tuple[dict[str, list[int]], Scheduler, list[int]]:
    s = make(blocks=blocks, cpu=8, preemption_mode=mode, max_num_batched_tokens=24)
    reqs = [req(f"r{i}", 3 + 5 * i, max_tokens=6 + 7 * i, arrival=i) for i in range(5)]
    for r in reqs:
        s.add(r)
    commits = drive(s, depth, Markov(eos_every))
    return {r.request_id: list(r.output_ids) for r in reqs}, s, commits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("eos_every", [0, 29])
def test_pipelined_tokens_equal_serial_tokens(mode: str, eos_every: int) -> None:
    """Same tokens with one plan in flight or two, under preemption (a small pool), and finishes by
    length or EOS found a step late; every block comes back."""
    serial, _, _ = outputs(mode, 1, 16, eos_every)
    piped, s, commits = outputs(mode, 2, 16, eos_every)
    assert piped == serial
    for rid, toks in piped.items():
        limit = 6 + 7 * int(rid[1:])
        assert len(toks) == limit or (toks and toks[-1] == EOS and EOS not in toks[:-1])
    assert s.blocks.num_free(DEVICE) == s.blocks.total(DEVICE) and s.blocks.num_free(CPU) == s.blocks.total(CPU)
    assert 2 in commits, "commits happened with two plans at the executor"
    assert s.counters.preemptions_swap + s.counters.preemptions_recompute > 0


def test_a_finish_found_late_drops_the_extra_token() -> None:
    s = make(blocks=16)
    s.add(req("a", 5, max_tokens=2))
    first = s.schedule()
    s.launch(first)
    second = s.schedule()  # built before the first step's token is known
    assert [x.req.request_id for x in second.scheduled] == ["a"] and second.scheduled[0].samples
    plan = PlanBuilder().build(second, 1, [])
    assert plan.seqs[0].from_last_sample and list(plan.seqs[0].token_ids) == []
    assert plan.seqs[0].num_generated == 1
    s.launch(second)
    assert s.schedule().scheduled == [], "its token in flight ends it by length: nothing more is planned"
    s.update(first, {"a": 11})
    assert s.requests["a"].output_ids == [11]
    (done,) = s.update(second, {"a": 12})
    assert done.finish_reason == Finish.LENGTH and done.output_ids == [11, 12]
    rec = s.take_record()
    assert rec.new_tokens == {"a": [11, 12]}


def test_eos_found_late_never_records_the_token_after_it() -> None:
    s = make(blocks=16)
    s.add(req("a", 5, max_tokens=10))
    first = s.schedule()
    s.launch(first)
    second = s.schedule()
    s.launch(second)
    (done,) = s.update(first, {"a": EOS})
    assert done.finish_reason == Finish.STOP
    assert s.blocks.num_free(DEVICE) == s.blocks.total(DEVICE)
    assert s.update(second, {"a": 99}) == []
    assert done.output_ids == [EOS] and s.take_record().new_tokens == {"a": [EOS]}


def test_abort_between_launch_and_result_frees_every_block() -> None:
    s = make(blocks=16)
    s.add(req("a", 9, max_tokens=10))
    s.add(req("b", 3, max_tokens=10))
    first = s.schedule()
    s.launch(first)
    second = s.schedule()
    s.launch(second)
    s.finish("a", Finish.ABORT)
    s.update(first, {"a": 20, "b": 21})
    s.update(second, {"a": 22, "b": 23})
    assert s.take_record().new_tokens == {"b": [21, 23]}
    s.finish("b", Finish.ABORT)
    assert s.blocks.num_free(DEVICE) == s.blocks.total(DEVICE)


def test_a_plan_that_swaps_is_followed_only_after_its_result() -> None:
    pipe = Pipeline(2)
    assert pipe.can_launch() and not pipe.wait_first() and not pipe.wait_after(False)
    plain = Flight(SchedulerOutput(), 0, 0.0, {"a": 4})
    pipe.flights.append(plain)
    assert pipe.can_launch() and not pipe.wait_first() and not pipe.wait_after(True) and pipe.wait_after(False)
    assert pipe.can_commit()
    swapping = Flight(SchedulerOutput(swap_out=[BlockMove(DEVICE, 1, CPU, 0)]), 1, 0.0, {"a": 5, "b": 0})
    pipe.flights.append(swapping)
    assert pipe.wait_first() and not pipe.can_commit()
    assert pipe.starts() == {"a": 4, "b": 0}, "the oldest plan says what is computed for sure"
    pipe.flights.popleft()
    assert not pipe.can_launch() and pipe.wait_after(False) and not pipe.can_commit()
    serial = Pipeline(1)
    serial.flights.append(plain)
    assert not serial.wait_first() and serial.wait_after(True) and not serial.can_launch()


def test_a_swap_alone_in_flight_is_committed_under_its_seq() -> None:
    """A commit may record a plan's swaps before their result only while it is the one plan in flight, its seq
    above every earlier plan's (so the executor's applied seq says whether it started), and only swaps."""
    swap = SchedulerOutput(swap_out=[BlockMove(DEVICE, 1, CPU, 0)])
    pipe = Pipeline(2, seq=5)
    pipe.add(Flight(SchedulerOutput(), 0, 0.0, {"a": 4}, seq=6))
    pipe.add(Flight(swap, 1, 0.0, {"a": 5}, seq=7))
    assert not pipe.can_commit(), "an older plan is in flight: what the swap takes may change"
    pipe.flights.popleft()
    assert pipe.can_commit() and pipe.moving() == 7
    pipe.flights.popleft()
    assert pipe.can_commit() and pipe.moving() == 0

    pipe.add(Flight(SchedulerOutput(), 2, 0.0, {"a": 6}, seq=8))
    pipe.add(Flight(swap, 3, 0.0, {"a": 7}, seq=8))  # no write since the plan before: its seq says nothing
    pipe.flights.popleft()
    assert not pipe.can_commit()
    pipe.flights.popleft()

    fork = SchedulerOutput(copies=[BlockMove(DEVICE, 1, DEVICE, 2)])
    pipe.add(Flight(fork, 4, 0.0, {"a": 8}, seq=9))
    assert not pipe.can_commit(), "a fork's copy waits for its result"
    first = Pipeline(2, seq=9)  # a new leader: its predecessor's plans carry at most the restored seq
    first.add(Flight(swap, 0, 0.0, {}, seq=9))
    assert not first.can_commit()


def test_swap_sources_stay_pending_until_their_own_step_reports() -> None:
    s = make(blocks=4, cpu=4)
    bm = s.blocks
    a, b = req("a", 8), req("b", 4)
    bm.append(a, 8)
    bm.append(b, 4)
    a.num_computed, b.num_computed = 8, 4
    out_a, out_b = bm.swap_out(a), bm.swap_out(b)
    assert bm.num_free(DEVICE) == 1 and bm.num_free_soon(DEVICE) == 4
    bm.release_pending(out_a)
    assert bm.num_free(DEVICE) == 3 and [t for t, _ in bm.pending] == [DEVICE]
    bm.release_pending(out_b)
    assert bm.num_free(DEVICE) == 4 and bm.pending == []


def test_a_commit_stores_for_in_flight_requests_only_what_reported_steps_computed() -> None:
    s = make(blocks=16)
    s.add(req("a", 5))
    first = s.schedule()
    s.launch(first)
    s.update(first, {"a": 11})
    second = s.schedule()
    s.launch(second)
    assert s.requests["a"].num_computed == 6
    ops = CommitWriter(Keys("t"), "x", "fcfs").ops(s.take_record(), s.blocks.is_free, None, {"a": 5})
    (computed,) = [op for op in ops if op[0] == "HSET" and op[1].endswith("computed")]
    assert computed[2:] == ["a", "5"]


def test_last_sampled_resolves_before_anything_reads_the_tokens() -> None:
    last = LastSampled()
    seq = type("Seq", (), {"request_id": "a", "token_ids": [5], "from_last_sample": True})()
    with pytest.raises(UnknownSample):
        last.resolve([seq])
    last.record([("a", 9)])
    last.resolve([seq])
    assert seq.token_ids == [5, 9] and not seq.from_last_sample
    last.forget("a")
    assert len(last) == 0


def test_a_request_that_starts_over_takes_no_start_from_older_plans() -> None:
    """Requeued while a plan runs it, then claimed back as a new object (or preempted for recompute
    and admitted again in the plan that preempted it): the older plan's start is not what it has
    computed now (the state machine found a commit storing it)."""
    s = make(blocks=64, max_num_batched_tokens=8)
    s.add(Request("a", list(range(10, 30)), Params(max_tokens=50)))
    first = s.schedule()
    s.launch(first)
    s.update(first, {})
    pipe = Pipeline(2)
    second = s.schedule()
    s.launch(second)
    pipe.add(Flight.of(second, 1))  # its second chunk, from 8
    s.requeue(s.requests["a"])
    back = Request("a", list(range(10, 30)), Params(max_tokens=50))
    s.add(back)
    third = s.schedule()
    s.launch(third)
    pipe.add(Flight.of(third, 2))  # from 0 again, in other blocks
    assert pipe.starts() == {"a": 8}, "without the live requests, the stale start"
    assert pipe.starts(s.requests) == {"a": 0}
    pipe.add(Flight(SchedulerOutput(preempted=[back]), 3, 0.0, {}))  # preempted (and maybe admitted again)
    assert pipe.starts(s.requests) == {}


def test_a_request_ending_in_flight_is_waited_for_not_preempted() -> None:
    """Pipelined: ``b``'s token in flight ends it by length; ``a`` needs a block and none is free. ``a`` waits a
    step for ``b``'s blocks instead of swapping out a request about to finish (or itself)."""
    s = make(blocks=3, cpu=8, preemption_mode="swap")
    s.add(req("a", 3, max_tokens=20, arrival=0))
    s.add(req("b", 7, max_tokens=2, arrival=1))
    first = s.schedule()
    s.launch(first)
    second = s.schedule()  # a at position 3, b at 7: both within their blocks
    assert sorted(x.req.request_id for x in second.scheduled) == ["a", "b"]
    s.launch(second)
    third = s.schedule()  # a needs a fourth block for position 4; b ends with its token in flight
    assert third.scheduled == [] and third.preempted == [] and third.swap_out == []
    s.update(first, {"a": 11, "b": 12})
    (done,) = s.update(second, {"a": 13, "b": 14})
    assert done.request_id == "b" and done.finish_reason == Finish.LENGTH and done.output_ids == [12, 14]
    fourth = s.schedule()
    assert [x.req.request_id for x in fourth.scheduled] == ["a"]
    assert s.counters.preemptions_swap == s.counters.preemptions_recompute == 0
