"""The pure scheduling core on plain data: no Redis, no gRPC, no model.

``run_step`` plays the executor: every sampled sequence gets token 7 (never EOS),
which isolates the decisions from the model.
"""

from __future__ import annotations

from scheduler_svc.core.blocks import CPU, DEVICE, DISK, BlockManager, Pool
from scheduler_svc.core.output import SchedulerOutput
from scheduler_svc.core.queue import FCFSQueue, PriorityQueue
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig

EOS = 2


def make(blocks: int = 16, cpu: int = 0, disk: int = 0, **cfg: object) -> Scheduler:
    config = SchedulerConfig(max_model_len=4096, eos_token_ids=(EOS,), watermark=0.0, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(4, Pool.fresh(blocks), Pool.fresh(cpu), Pool.fresh(disk)))


def req(rid: str, prompt: int, max_tokens: int = 100, priority: int = 0, arrival: int = 0, **kw: object) -> Request:
    return Request(
        rid,
        list(range(10, 10 + prompt)),
        Params(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
        priority=priority,
        arrival=arrival,
    )


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {x.req.request_id: token for x in out.scheduled if x.samples})
    return out


def owned(s: Scheduler) -> list[int]:
    return sorted(b for r in s.requests.values() for b in r.blocks)


def check_blocks(s: Scheduler) -> None:
    bm = s.blocks
    for tier in (DEVICE, CPU, DISK):
        mine = [
            b for r in s.requests.values() for t, b in ([(DEVICE, x) for x in r.blocks] + r.swap_blocks) if t == tier
        ]
        assert len(mine) == len(set(mine)), "a block is owned twice"
        assert not any(bm.is_free(tier, b) for b in mine), "an owned block is on the free list"
        assert len(mine) + bm.num_free(tier) + sum(t == tier for t, _ in bm.pending) == bm.total(tier)
    for r in s.running:
        assert len(r.blocks) * 4 >= r.num_computed


def test_chunked_prefill_shares_steps_with_decodes() -> None:
    s = make(blocks=64, max_num_batched_tokens=8)
    for i in range(3):
        s.add(req(f"d{i}", 2, arrival=i))
    run_step(s)  # 3 prompts of 2 tokens prefilled together
    s.add(req("long", 30, arrival=9))
    chunks = []
    while s.requests["long"].num_computed < 30:
        out = run_step(s)
        sizes = {x.req.request_id: x.num_tokens for x in out.scheduled}
        assert all(sizes[f"d{i}"] == 1 for i in range(3)), "decodes must run every step"
        chunks.append(sizes["long"])
        assert out.num_tokens <= 8
    assert chunks == [5, 5, 5, 5, 5, 5]
    check_blocks(s)


def test_fcfs_admits_in_arrival_order() -> None:
    s = make(blocks=64, max_num_seqs=1)
    for i in (0, 1, 2):
        s.add(req(f"r{i}", 3, max_tokens=2, arrival=i, priority=2 - i))
    started = []
    while s.has_work:
        out = run_step(s)
        started += [x.req.request_id for x in out.scheduled if x.start == 0]
    assert started == ["r0", "r1", "r2"]


def test_recompute_preempts_latest_admitted_and_resumes() -> None:
    s = make(blocks=6, preemption_mode="recompute")
    s.add(req("a", 8, max_tokens=12, arrival=0))
    s.add(req("b", 8, max_tokens=12, arrival=1))
    run_step(s)  # both prefilled: 2 + 2 blocks (+1 each soon)
    victims = []
    while s.has_work:
        out = run_step(s)
        victims += [v.request_id for v in out.preempted]
        check_blocks(s)
    assert victims and set(victims) == {"b"}
    assert s.counters.preemptions_recompute == len(victims)
    assert s.blocks.num_free() == 6


def test_swap_moves_blocks_out_and_back_and_spills_to_disk() -> None:
    s = make(blocks=6, cpu=1, disk=8, preemption_mode="swap")
    s.add(req("a", 8, max_tokens=12, arrival=0))
    s.add(req("b", 8, max_tokens=12, arrival=1))
    swapped_out: list = []
    swapped_in: list = []
    while s.has_work:
        out = run_step(s)
        swapped_out += out.swap_out
        swapped_in += out.swap_in
        check_blocks(s)
    assert s.counters.preemptions_swap >= 1
    assert {m.dst_tier for m in swapped_out} == {CPU, DISK}, "the CPU tier fills first, then disk"
    assert {(m.src_tier, m.src) for m in swapped_in} <= {(m.dst_tier, m.dst) for m in swapped_out}
    assert len(swapped_in) == len(swapped_out)
    assert [s.blocks.num_free(t) for t in (DEVICE, CPU, DISK)] == [6, 1, 8]


def preempt_once(s: Scheduler) -> tuple[int, int]:
    """Run two requests that outgrow six blocks until the first preemption; its (swaps, recomputes)."""
    s.add(req("a", 8, max_tokens=12, arrival=0))
    s.add(req("b", 8, max_tokens=12, arrival=1))
    while s.counters.preemptions_swap + s.counters.preemptions_recompute == 0:
        run_step(s)
    return s.counters.preemptions_swap, s.counters.preemptions_recompute


def test_auto_swaps_when_copies_cost_less_than_recomputing() -> None:
    s = make(blocks=6, cpu=8, preemption_mode="auto")
    s.moves.costs.stepped(8, 8.0)  # 1 ms a token computed
    s.moves.costs.copied(4, 0.4)  # 0.1 ms a block copied
    assert preempt_once(s) == (1, 0)


def test_auto_recomputes_when_copies_cost_more() -> None:
    s = make(blocks=6, cpu=8, preemption_mode="auto")
    s.moves.costs.stepped(8, 0.8)  # 0.1 ms a token: 1.2 ms for the victim's 12 tokens
    s.moves.costs.copied(1, 1.0)  # 1 ms a block: 2 x 3 blocks out and back
    assert preempt_once(s) == (0, 1)


def test_auto_swaps_before_anything_is_measured_then_learns() -> None:
    """Unmeasured, a swap counts as free (tried, then measured), as a pull does."""
    assert preempt_once(make(blocks=6, cpu=8, preemption_mode="auto")) == (1, 0)


def test_auto_recomputes_when_the_cpu_tier_lacks_room_and_never_spills_to_disk() -> None:
    s = make(blocks=6, cpu=1, disk=8, preemption_mode="auto")
    assert preempt_once(s) == (0, 1)
    while s.has_work:
        out = run_step(s)
        assert not any(m.dst_tier == DISK for m in out.swap_out)


def test_copy_costs_are_learnt_per_block() -> None:
    s = make(blocks=6, cpu=8, preemption_mode="auto")
    s.moves.costs.copied(0, 5.0)  # a step without copies teaches nothing
    assert s.moves.costs.copy_ms_per_block.value is None
    s.moves.costs.copied(4, 2.0)
    assert s.moves.costs.copy_ms_per_block.value == 0.5
    assert s.moves.costs.as_dict()["copy_ms_per_block"] == 0.5


def test_swapped_source_blocks_are_not_reused_in_the_same_step() -> None:
    s = make(blocks=6, cpu=8, preemption_mode="swap")
    s.add(req("a", 8, max_tokens=12, arrival=0))
    s.add(req("b", 8, max_tokens=12, arrival=1))
    while s.has_work:
        out = s.schedule()
        sources = {m.src for m in out.swap_out}
        used_now = {b for x in out.scheduled for b in x.req.blocks} | {m.dst for m in out.swap_in}
        assert not sources & used_now
        s.update(out, {x.req.request_id: 7 for x in out.scheduled if x.samples})


def test_priority_request_preempts_lower_priority_on_next_step() -> None:
    s = make(blocks=8, policy="priority", preemption_mode="recompute")
    for i in range(4):
        s.add(req(f"low{i}", 7, max_tokens=50, priority=10, arrival=i))
    run_step(s)
    assert s.blocks.num_free() == 0
    s.add(req("urgent", 7, max_tokens=5, priority=0, arrival=10))
    out = run_step(s)
    assert "urgent" in {x.req.request_id for x in out.scheduled}
    assert out.preempted and all(v.priority == 10 for v in out.preempted)
    assert out.preempted[0].request_id == "low3", "the least urgent, latest arrival goes first"


def test_priority_waiting_does_not_preempt_more_urgent_work() -> None:
    s = make(blocks=8, policy="priority")
    for i in range(4):
        s.add(req(f"hi{i}", 7, max_tokens=50, priority=0, arrival=i))
    run_step(s)
    s.add(req("low", 7, priority=5, arrival=10))
    out = run_step(s)
    assert not out.preempted and "low" not in {x.req.request_id for x in out.scheduled}


def test_max_num_seqs_and_watermark_limit_admission() -> None:
    s = Scheduler(SchedulerConfig(max_model_len=4096, max_num_seqs=2, watermark=0.25), BlockManager(4, Pool.fresh(16)))
    for i in range(4):
        s.add(req(f"r{i}", 4, arrival=i))
    run_step(s)
    assert len(s.running) == 2
    s2 = Scheduler(SchedulerConfig(max_model_len=4096, watermark=0.25), BlockManager(4, Pool.fresh(16)))
    s2.add(req("a", 40, arrival=0))  # 10 blocks: admitted, nothing else runs
    s2.add(req("b", 12, arrival=1))  # 3 blocks would leave 3 < watermark of 4
    run_step(s2)
    assert [r.request_id for r in s2.running] == ["a"]


def test_finish_conditions() -> None:
    s = make(blocks=64)
    s.add(req("eos", 3, arrival=0))
    s.add(req("ignore", 3, max_tokens=3, ignore_eos=True, arrival=1))
    s.add(req("stopid", 3, stop_token_ids=(9,), arrival=2))
    out = s.schedule()
    finished = s.update(out, {"eos": EOS, "ignore": EOS, "stopid": 9})
    assert {r.request_id: r.finish_reason for r in finished} == {"eos": Finish.STOP, "stopid": Finish.STOP}
    while s.has_work:
        finished = s.update(s.schedule(), {"ignore": EOS})
    assert finished[0].finish_reason == Finish.LENGTH
    assert len(finished[0].output_ids) == 3
    assert s.blocks.num_free() == 64


def test_abort_frees_blocks_in_every_state() -> None:
    s = make(blocks=6, cpu=8, preemption_mode="swap")
    s.add(req("a", 8, arrival=0))
    s.add(req("b", 8, arrival=1))
    s.add(req("c", 8, arrival=2))
    for _ in range(6):
        run_step(s)
    states = {r.request_id: r.status for r in s.requests.values()}
    assert Status.SWAPPED in states.values() or Status.WAITING in states.values()
    for rid in list(s.requests):
        assert s.finish(rid, Finish.ABORT).finish_reason == Finish.ABORT
    assert [s.blocks.num_free(t) for t in (DEVICE, CPU)] == [6, 8]
    assert not s.has_work


def test_queues_order() -> None:
    fcfs, prio = FCFSQueue(), PriorityQueue()
    reqs = [req("x", 1, priority=3, arrival=0), req("y", 1, priority=1, arrival=1), req("z", 1, priority=1, arrival=2)]
    for r in reqs:
        fcfs.add(r)
        prio.add(r)
    assert [r.request_id for r in fcfs] == ["x", "y", "z"]
    assert [prio.pop().request_id for _ in range(3)] == ["y", "z", "x"]
    prio.add(reqs[0])
    prio.remove(reqs[0])
    assert prio.peek() is None and len(prio) == 0
    again = req("x", 1, priority=3, arrival=0)  # the same request, claimed back after a requeue
    prio.add(reqs[0])
    prio.remove(reqs[0])
    prio.add(again)
    prio.add(req("w", 1, priority=3, arrival=0))
    assert [prio.pop().request_id for _ in range(2)] == ["w", "x"]


def test_swapped_requests_return_before_new_work() -> None:
    s = make(blocks=6, cpu=8, preemption_mode="swap")
    s.add(req("a", 8, max_tokens=8, arrival=0))
    s.add(req("b", 8, max_tokens=12, arrival=1))
    while not len(s.swapped):
        run_step(s)
    swapped = s.swapped.peek()
    s.add(req("late", 4, max_tokens=4, arrival=5))
    order = []
    while s.has_work:
        out = run_step(s)
        order += [x.req.request_id for x in out.scheduled if x.req.request_id not in order]
    assert order.index(swapped.request_id) < order.index("late")


def test_a_reported_prefill_chunk_records_what_its_request_computed() -> None:
    """The pipelined loop commits a plan's requests at their start while it is in flight; the
    report of a chunk that samples nothing must record its request again, or the commit after
    it keeps the start (a restarted loop would reload fewer computed tokens than were written)."""
    s = make(blocks=64, max_num_batched_tokens=4)
    s.add(req("long", 10))
    out = s.schedule()
    s.launch(out)
    s.take_record()  # the commit made while the chunk is in flight
    s.update(out, {})
    rec = s.take_record()
    assert rec.touched == {"long": s.requests["long"]}
    assert rec.touched["long"].num_computed == 4
