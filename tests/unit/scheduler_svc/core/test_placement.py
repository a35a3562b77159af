"""Placement on plain data: which queued requests each executor's loop claims."""

from __future__ import annotations

from scheduler_svc.core.placement import Candidate, PoolView, peek_depth, pick, preemption_target

BS = 16


def pool(
    name: str,
    total: int = 64,
    free: int | None = None,
    running: int = 0,
    serving: bool = True,
    max_len: int = 2048,
    held: dict[int, int] | None = None,
    max_num_seqs: int = 256,
) -> PoolView:
    return PoolView(
        name,
        serving,
        BS,
        (total, 0, 0),
        (total if free is None else free, 0, 0),
        running,
        0,
        max_len,
        max_num_seqs,
        0,
        held or {},
    )


def cand(i: int, tokens: int = 32, max_tokens: int = 32, priority: int = 0) -> Candidate:
    return Candidate(f"{i:016d}:r{i}", f"r{i}", tokens, tokens, max_tokens, priority)


def claims(cands: list[Candidate], views: dict[str, PoolView], policy: str = "fcfs") -> dict[str, list[str]]:
    """What every loop would claim from the same look at the queue."""
    return {e: [c.request_id for c in pick(cands, e, views, policy=policy, seats=256, budget=2048)] for e in views}


def test_a_burst_spreads_over_idle_pools_without_collisions() -> None:
    views = {e: pool(e) for e in ("a", "b", "c")}
    got = claims([cand(i) for i in range(6)], views)
    taken = [r for rs in got.values() for r in rs]
    assert sorted(taken) == [f"r{i}" for i in range(6)], "each request claimed by exactly one loop"
    assert all(len(rs) == 2 for rs in got.values()), got


def test_the_least_loaded_pool_takes_work() -> None:
    views = {"a": pool("a", free=10, running=3), "b": pool("b", free=60, running=1)}
    assert claims([cand(0)], views) == {"a": [], "b": ["r0"]}


def test_an_idle_executor_takes_work_a_busier_one_would_get() -> None:
    # b is less loaded by blocks but busy; a runs nothing: a must not idle while r0 waits.
    views = {"a": pool("a", total=32, free=20, running=0), "b": pool("b", free=60, running=5)}
    assert claims([cand(0)], views)["a"] == ["r0"]


def test_requests_no_pool_can_ever_hold_wait_without_blocking_others() -> None:
    views = {"a": pool("a", total=8)}  # 128 tokens at most
    big, small = cand(0, tokens=100, max_tokens=200), cand(1, tokens=10, max_tokens=10)
    assert claims([big, small], views) == {"a": ["r1"]}


def test_head_of_line_stops_at_a_request_that_fits_later() -> None:
    views = {"a": pool("a", total=8, free=2, running=1)}
    assert claims([cand(0, tokens=64, max_tokens=16), cand(1, tokens=8, max_tokens=8)], views) == {"a": []}


def test_draining_pools_take_nothing() -> None:
    views = {"a": pool("a", serving=False), "b": pool("b", free=10, running=4)}
    assert claims([cand(0)], views) == {"a": [], "b": ["r0"]}


def test_seats_and_budget_bound_one_loop() -> None:
    views = {"a": pool("a")}
    cands = [cand(i) for i in range(5)]
    assert len(pick(cands, "a", views, policy="fcfs", seats=2, budget=2048)) == 2
    assert len(pick(cands, "a", views, policy="fcfs", seats=9, budget=64)) == 2  # 32 tokens each


def test_an_urgent_request_preempts_where_it_costs_least() -> None:
    # Neither pool has room. a would lose 6 blocks of priority-5 work; b only needs 1 more block
    # freed from priority-9 work. The request needs 2 blocks (32 tokens).
    a = pool("a", total=8, free=0, running=2, held={5: 6, 0: 2})
    b = pool("b", total=8, free=1, running=2, held={9: 7})
    urgent = cand(0, tokens=32, max_tokens=4, priority=1)
    assert preemption_target(urgent, [a, b], budget=2048) == "b"
    assert claims([urgent], {"a": a, "b": b}, policy="priority") == {"a": [], "b": ["r0"]}
    assert claims([urgent], {"a": a, "b": b}, policy="fcfs") == {"a": [], "b": []}, "FCFS never preempts for it"


def test_no_preemption_for_work_that_is_not_less_urgent() -> None:
    a = pool("a", total=8, free=0, running=2, held={0: 8})
    assert preemption_target(cand(0, priority=0), [a], budget=2048) is None


def test_equal_costs_prefer_the_least_urgent_victims() -> None:
    a = pool("a", total=8, free=0, running=1, held={3: 8})
    b = pool("b", total=8, free=0, running=1, held={7: 8})
    assert preemption_target(cand(0, priority=1), [a, b], budget=2048) == "b"


def test_a_request_goes_to_the_pool_caching_its_prefix_within_the_load_bound() -> None:
    from dataclasses import replace

    from scheduler_svc.core.placement import PREFIX_LOAD_BOUND

    c = replace(cand(0, tokens=600), hits={"b": 30})
    views = {"a": pool("a", free=60), "b": pool("b", free=50, running=1)}
    assert claims([c], views) == {"a": [], "b": ["r0"]}, "b caches 30 of its blocks: worth 10/64 more load"
    busy = 64 - int(64 * (1 - PREFIX_LOAD_BOUND)) - 2  # b's usage exceeds a's by more than the bound
    views = {"a": pool("a", free=64), "b": pool("b", free=64 - busy - 16, running=4)}
    assert claims([c], views) == {"a": ["r0"], "b": []}, "past the bound, load wins"
    c2 = replace(c, hits={"a": 3, "b": 30})
    views = {"a": pool("a", free=44, running=3), "b": pool("b", free=40, running=3)}
    assert claims([c2], views) == {"a": [], "b": ["r0"]}, "the longest cached prefix wins"
    views = {"a": pool("a", free=60, running=0), "b": pool("b", free=56, running=2)}
    assert claims([c], views) == {"a": [], "b": ["r0"]}, "an idle pool does not take it from the one caching it"


def test_a_cached_prefix_costs_no_blocks_and_no_budget() -> None:
    from dataclasses import replace

    views = {"a": pool("a", total=64, free=40, running=2)}
    behind = [replace(cand(i, tokens=528), hits={"a": 32}) for i in range(6)]
    got = pick(behind, "a", views, policy="fcfs", seats=256, budget=1024)
    assert len(got) == 6, "each needs 2 new blocks and 16 tokens of budget"
    cold = [cand(i, tokens=528) for i in range(6)]
    assert len(pick(cold, "a", views, policy="fcfs", seats=256, budget=1024)) == 1


def test_a_look_as_deep_as_peek_depth_claims_what_the_whole_queue_would() -> None:
    """The loop reads ``peek_depth(seats, pools)`` of the queue, not all of it: with every pool offering the
    same seats, what each loop claims from that head is what it claims from the whole queue."""
    queue = [cand(i, tokens=16 + 16 * (i % 3)) for i in range(40)]
    for seats, free in ((1, 64), (3, 64), (5, 6), (8, 64)):
        views = {e: pool(e, free=free, max_num_seqs=seats) for e in ("a", "b", "c")}
        depth = peek_depth(seats, len(views))
        assert depth < len(queue)
        for e in views:
            whole = pick(queue, e, views, policy="fcfs", seats=seats, budget=2048)
            head = pick(queue[:depth], e, views, policy="fcfs", seats=seats, budget=2048)
            assert [c.request_id for c in head] == [c.request_id for c in whole], (seats, free, e)
