"""Parallel-sampling groups in the pure core (no Redis, no model): admitted together, the prompt
computed once and forked (full blocks shared, the partial one copied on write), preempted and
resumed all or nothing. ``step`` plays the executor: every sampled sequence gets token 7 unless
``tokens`` says otherwise."""

from __future__ import annotations

from collections import Counter

from scheduler_svc.core.blocks import DEVICE, BlockManager, Pool
from scheduler_svc.core.output import SchedulerOutput
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig

BS = 4
EOS = 2


def make(blocks: int = 64, caching: bool = False, **cfg: object) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=4096, eos_token_ids=(EOS,), watermark=0.0, enable_prefix_caching=caching, **cfg
    )  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(BS, Pool.fresh(blocks), caching=caching))


def group(gid: str, n: int, prompt: int, max_tokens: int = 100, arrival: int = 0) -> list[Request]:
    ids = list(range(10, 10 + prompt))
    return [
        Request(f"{gid}#{i}", list(ids), Params(max_tokens=max_tokens), arrival=arrival + i, group=gid, index=i)
        for i in range(n)
    ]


def step(s: Scheduler, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {x.req.request_id: (tokens or {}).get(x.req.request_id, 7) for x in out.scheduled if x.samples})
    return out


def check_refs(s: Scheduler) -> None:
    """Every device block's count is its holders; free ones are held by nobody."""
    held = Counter(b for r in s.requests.values() for b in r.blocks)
    bm = s.blocks
    for b in range(bm.total(DEVICE)):
        assert bm.refs[b] == held[b], f"block {b}: {bm.refs[b]} refs, {held[b]} holders"
        assert bool(bm.is_free(DEVICE, b)) == (held[b] == 0)


def test_prompt_is_computed_once_and_forked() -> None:
    s = make()
    for r in group("g", 4, prompt=10):
        s.add(r)
    first = step(s)
    assert [(x.req.request_id, x.start, x.num_tokens) for x in first.scheduled] == [("g#0", 0, 10)]
    assert all(s.requests[f"g#{i}"].status == Status.RUNNING and not s.requests[f"g#{i}"].blocks for i in (1, 2, 3))
    second = step(s)
    # Each mate computes only the last prompt token, in a copy of the partial block (positions 8, 9).
    assert sorted((x.req.request_id, x.start, x.num_tokens) for x in second.scheduled) == [
        ("g#0", 10, 1),
        ("g#1", 9, 1),
        ("g#2", 9, 1),
        ("g#3", 9, 1),
    ]
    head = s.requests["g#0"]
    assert [(m.src, m.dst) for m in second.copies] == [
        (head.blocks[2], s.requests[f"g#{i}"].blocks[2]) for i in (1, 2, 3)
    ]
    for i in (1, 2, 3):
        assert s.requests[f"g#{i}"].blocks[:2] == head.blocks[:2]
    assert s.counters.forked_tokens == 3 * 9
    check_refs(s)
    assert s.blocks.used(DEVICE) == 3 + 3  # the head's 3 blocks, one copy per mate: 12 without sharing
    for _ in range(6):
        step(s)
        check_refs(s)
    assert [len(s.requests[f"g#{i}"].output_ids) for i in range(4)] == [8, 7, 7, 7]  # mates start a step later


def test_a_block_aligned_prompt_shares_every_full_block_and_copies_nothing() -> None:
    s = make()
    for r in group("g", 3, prompt=9):  # the last prompt token starts block 2
        s.add(r)
    step(s)
    out = step(s)
    assert out.copies == []
    head = s.requests["g#0"]
    for i in (1, 2):
        mate = s.requests[f"g#{i}"]
        assert mate.blocks[:2] == head.blocks[:2] and mate.blocks[2] != head.blocks[2]
    check_refs(s)


def test_the_copy_source_stays_held_until_the_plan_is_reported() -> None:
    s = make()
    for r in group("g", 2, prompt=6):
        s.add(r)
    step(s)
    out = s.schedule()
    (copy,) = out.copies
    s.finish("g#0", Finish.ABORT)  # the source leaves before the copy ran
    assert not s.blocks.is_free(DEVICE, copy.src), "a block still to be copied was reused"
    s.update(out, {})
    assert s.blocks.is_free(DEVICE, copy.src)
    check_refs(s)


def test_a_group_waits_whole_for_room_while_others_run() -> None:
    s = make(blocks=12)
    s.add(Request("solo", list(range(10, 30)), Params(max_tokens=100)))  # 20 tokens: 5 blocks, then 6
    step(s)
    for r in group("g", 4, prompt=14, arrival=1):  # 4 blocks + 3 mates x 1 = 7 blocks, 6 free
        s.add(r)
    step(s)
    assert all(r.status == Status.WAITING for r in s.requests.values() if r.group)
    s.finish("solo", Finish.ABORT)
    step(s)
    assert all(r.status == Status.RUNNING for r in s.requests.values() if r.group)


def test_a_group_that_never_fits_whole_starts_with_what_fits() -> None:
    s = make(max_num_seqs=2)
    for r in group("g", 4, prompt=5):
        s.add(r)
    step(s)
    assert [r.request_id for r in s.running] == ["g#0", "g#1"]
    assert [r.request_id for r in s.waiting] == ["g#2", "g#3"]


def test_preemption_takes_the_whole_group_and_it_forks_again() -> None:
    s = make(blocks=10, preemption_mode="swap")
    s.add(Request("solo", list(range(10, 22)), Params(max_tokens=100)))  # 3 blocks
    step(s)
    for r in group("g", 3, prompt=14, arrival=1):  # 4 blocks + 2 x 1
        s.add(r)
    step(s)
    step(s)
    assert s.blocks.used(DEVICE) == 4 + 6  # solo grew a block
    # Decoding grows every sequence by a block every 4 tokens: the pool runs out, and the least
    # urgent (the last admitted, a mate) goes with its whole group.
    for _ in range(8):
        out = step(s)
        check_refs(s)
        if out.preempted:
            break
    assert {r.request_id for r in out.preempted} == {"g#0", "g#1", "g#2"}
    assert all(r.status == Status.WAITING and not r.swap_blocks for r in out.preempted), "a group recomputes"
    assert [r.request_id for r in s.waiting][:3] == ["g#0", "g#1", "g#2"]
    s.finish("solo", Finish.ABORT)
    outputs = {r.request_id: list(r.output_ids) for r in s.requests.values()}
    back = step(s)
    assert [x.req.request_id for x in back.scheduled] == ["g#0"]  # the prompt and its own tokens, once
    again = step(s)
    assert {x.req.request_id: x.start for x in again.scheduled if x.req.request_id != "g#0"} == {"g#1": 13, "g#2": 13}
    assert all(r.output_ids[: len(outputs[r.request_id])] == outputs[r.request_id] for r in s.requests.values())
    check_refs(s)


def test_a_source_that_ends_before_its_mates_forked_hands_its_prompt_on() -> None:
    s = make()
    for r in group("g", 3, prompt=10):
        s.add(r)
    step(s, {"g#0": EOS})  # its first token ends it, in the step that computed the prompt
    assert s.requests.get("g#0") is None
    heir = s.requests["g#1"]
    assert heir.source is None and heir.num_computed == 8 and len(heir.blocks) == 2  # full blocks only
    assert s.requests["g#2"].source is heir
    out = step(s)
    assert [(x.req.request_id, x.start, x.num_tokens) for x in out.scheduled] == [("g#1", 8, 2)]
    out = step(s)
    assert {x.req.request_id: x.start for x in out.scheduled} == {"g#1": 10, "g#2": 9}
    check_refs(s)


def test_a_mate_that_wants_prompt_logprobs_computes_its_prompt() -> None:
    s = make()
    head, mate = group("g", 2, prompt=6)
    mate.params = Params(max_tokens=100, prompt_logprobs=1)
    s.add(head)
    s.add(mate)
    out = step(s)
    assert sorted((x.req.request_id, x.start) for x in out.scheduled) == [("g#0", 0), ("g#1", 0)]


def test_relink_after_a_reload_puts_parked_mates_back_behind_their_source() -> None:
    s = make()
    for r in group("g", 3, prompt=10):
        s.add(r)
    step(s)
    for r in s.running:
        r.source = None  # what a reload from Redis knows
    s.relink()
    assert [r.source.request_id if r.source else None for r in s.running] == [None, "g#0", "g#0"]


def test_every_table_a_fork_or_a_hand_over_changes_is_recorded_for_the_commit() -> None:
    s = make(max_num_batched_tokens=4)
    for r in group("g", 2, prompt=5, max_tokens=1):
        s.add(r)
    step(s)  # 4 prompt tokens
    head_block = s.requests["g#0"].blocks[0]
    s.take_record()
    step(s)  # the last one: the head samples its only token and ends; its mate takes its full block
    rec = s.take_record()
    assert "g#1" in rec.touched, "the hand-over must reach Redis"
    assert rec.touched["g#1"].blocks == [head_block]
    s.add(Request("x", [1, 2, 3, 4, 5, 6], Params(max_tokens=2)))
    s.take_record()
    out = step(s)
    assert [x.req.request_id for x in out.scheduled] == ["g#1", "x"]


def test_group_helpers_on_plain_requests() -> None:
    """``core/group.py`` alone: who moves with whom, and what forking costs."""
    from scheduler_svc.core import group as groups

    g = group("g", 3, prompt=10)
    lone = Request("solo", list(range(10, 20)), Params(max_tokens=5))
    assert groups.mates_running([lone, *g], lone) == [lone]
    assert groups.mates_running([g[2], lone, g[0]], g[2]) == [g[0], g[2]], "index order, only the group's"
    g[1].params = Params(max_tokens=100, prompt_logprobs=1)
    assert groups.mates_waiting([*g, lone], g[0]) == [g[2]], "one that wants prompt logprobs computes its own"
    # 10-token prompt, blocks of 4: the first 9 tokens' 2 full blocks are shared; each mate needs 3 - 2 = 1.
    assert groups.fork_need(g[0], [g[1], g[2]], BS) == 2
    g[1].source = g[2].source = g[0]
    assert groups.waiting_on([*g, lone], g[0]) == [g[1], g[2]]
    g[0].blocks, g[1].source, g[2].source = [0, 1, 2], None, None
    groups.relink([*g, lone])
    assert g[1].source is g[0] and g[2].source is g[0] and g[0].source is None and lone.source is None
