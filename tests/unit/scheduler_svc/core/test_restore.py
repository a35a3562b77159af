"""Rebuilding an executor's scheduler from a snapshot of Redis, on plain data."""

from __future__ import annotations

from pagedserve.tiers import Tier
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.restore import Snapshot, pool_fields, restore
from scheduler_svc.core.scheduler import SchedulerConfig

CONFIG = SchedulerConfig(max_model_len=256, watermark=0.0)
TOTALS = (8, 4, 0)


def running(rid: str, blocks: list[int], arrival: int) -> Request:
    return Request(
        rid,
        list(range(10, 18)),
        Params(max_tokens=8),
        arrival=arrival,
        status=Status.RUNNING,
        num_computed=8,
        blocks=blocks,
    )


def snapshot(requests: list[tuple[Request, Finish | None]], free: list[int], seq: int = 7) -> Snapshot:
    return Snapshot(pool_fields(TOTALS, 4), (free, [0, 1, 2, 3], []), requests, seq)


def test_a_consistent_snapshot_is_kept_claims_go_back_and_cancels_finish() -> None:
    claimed = Request("claimed", [5, 6], Params(), arrival=3)  # claimed, but its step never committed
    snap = snapshot(
        [(running("a", [0, 1], 1), None), (running("b", [2, 3], 2), Finish.STOP), (claimed, None)], free=[4, 5, 6, 7]
    )
    r = restore(snap, TOTALS, CONFIG, 4, applied_seq=6)
    assert not r.reset
    assert list(r.sched.requests) == ["a"] and r.sched.requests["a"].blocks == [0, 1]
    rec = r.sched.take_record()
    assert [x.request_id for x in rec.requeued] == ["claimed"]
    assert [(x.request_id, x.finish_reason) for x in rec.finished] == [("b", Finish.STOP)]
    assert r.sched.blocks.num_free() == 6, "b's blocks came back"


def test_inconsistent_ownership_resets_the_pool() -> None:
    snap = snapshot([(running("a", [0, 1], 1), None), (running("b", [1, 2], 2), None)], free=[3, 4, 5, 6, 7])
    r = restore(snap, TOTALS, CONFIG, 4)
    assert r.reset and not r.sched.requests
    assert sorted(x.request_id for x in r.sched.take_record().requeued) == ["a", "b"]
    assert r.sched.blocks.num_free() == 8


def with_swapped(moving: int = 0) -> Snapshot:
    """ "a" running on device blocks 0-1, "s" swapped out to CPU blocks 0-1, after 7 writes."""
    swapped = Request(
        "s",
        list(range(10, 18)),
        Params(),
        arrival=2,
        status=Status.SWAPPED,
        num_computed=8,
        swap_blocks=[(Tier.CPU, 0), (Tier.CPU, 1)],
    )
    return Snapshot(
        pool_fields(TOTALS, 4),
        ([2, 3, 4, 5, 6, 7], [2, 3], []),
        [(running("a", [0, 1], 1), None), (swapped, None)],
        seq=7,
        moving=moving,
    )


def test_an_executor_ahead_of_redis_means_lost_writes_and_a_reset() -> None:
    """Redis came back from an older AOF: the executor ran plans built on writes it no longer has."""
    snap = with_swapped()
    assert not restore(snap, TOTALS, CONFIG, 4, applied_seq=6).reset, "the plan before the last commit: trusted"
    r = restore(snap, TOTALS, CONFIG, 4, applied_seq=9)
    assert r.reset
    requeued = r.sched.take_record().requeued
    assert sorted(x.request_id for x in requeued) == ["a", "s"]
    assert all(x.num_computed == 0 and not x.blocks and not x.swap_blocks for x in requeued)


def test_swaps_recorded_before_their_plan_ran_reset_the_pool_unless_the_executor_started_it() -> None:
    """A commit made while the plan that swaps "s" out was in flight names that plan's seq (``moving``); the plan
    ran if and only if the executor applied that seq (it refuses a seq below one it ran)."""
    snap = with_swapped(moving=6)
    kept = restore(snap, TOTALS, CONFIG, 4, applied_seq=6)
    assert not kept.reset and kept.sched.requests["s"].swap_blocks == [(Tier.CPU, 0), (Tier.CPU, 1)]
    r = restore(snap, TOTALS, CONFIG, 4, applied_seq=5)
    assert r.reset, "the swap never ran: the CPU blocks do not hold s's KV"
    requeued = r.sched.take_record().requeued
    assert sorted(x.request_id for x in requeued) == ["a", "s"]
    assert all(x.num_computed == 0 and not x.blocks and not x.swap_blocks for x in requeued)


def test_the_prefix_cache_survives_a_new_leader_and_a_lost_step_resets_the_pool() -> None:
    """Evictable cached blocks come back with their hashes and LRU order. After a plan that ran on this very state
    but never committed (applied_seq == seq), the KV of blocks Redis says are held or cached may have been
    overwritten (a victim it preempted for recompute gave its blocks to another request in that plan): every
    request recomputes from an empty pool, and the cache goes."""
    from scheduler_svc.core import prefix

    a = running("a", [0, 1], 1)
    h = prefix.extend([], list(range(10, 18)), None, 4, 2)
    cache = {0: h[0], 1: h[1], 5: b"\x01" * 32, 6: b"\x02" * 32}
    snap = Snapshot(pool_fields(TOTALS, 4), ([2, 3, 4, 5, 6, 7], [0, 1, 2, 3], []), [(a, None)], 7, cache, {6: 1, 5: 2})
    r = restore(snap, TOTALS, CONFIG, 4, applied_seq=6)
    bm = r.sched.blocks
    assert not r.reset and bm.hash_of == cache and list(bm.lru) == [6, 5] and bm.refs[:2] == [1, 1]
    b = Request("b", list(range(10, 18)) + [1], Params())
    assert bm.lookup(b) == [0, 1], "a new request hits the reloaded cache"
    r = restore(snap, TOTALS, CONFIG, 4, applied_seq=7)
    assert r.reset and not r.sched.requests and not r.sched.blocks.hash_of and r.sched.blocks.num_free() == 8
    assert [x.request_id for x in r.sched.take_record().requeued] == ["a"]
