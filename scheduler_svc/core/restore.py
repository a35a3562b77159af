"""Rebuilding one executor's scheduler from what Redis holds, and taking in new
work and cancellations: pure functions over plain data (``RedisStore`` loads
the ``Snapshot``; the loop commits what they record)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.tiers import TIERS
from scheduler_svc.core.blocks import BlockManager, Pool
from scheduler_svc.core.request import Finish, Request, Status
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.snapshot import Snapshot


@dataclass(slots=True)
class Restored:
    sched: Scheduler
    reset: bool  # the pool's state was unusable: its free sets must be rebuilt before anything else


def pool_fields(totals: tuple[int, ...], block_size: int) -> dict[str, str]:
    return {"blocks": ",".join(map(str, totals)), "block_size": str(block_size)}


def consistent(bm: BlockManager, requests: list[Request], cache: dict[int, bytes] | None = None) -> bool:
    """Every swap block is free or owned by exactly one request; every device block is free
    (plain or cached-evictable) or held by one or more requests, and only a cached block (one
    with a hash in ``cache``) or a block of one parallel-sampling group by more than one; no two
    blocks share a hash."""
    cache = cache or {}
    owned: list[dict[int, str]] = [{}, {}, {}]  # block -> the group of its holder ("" for none)
    for req in requests:
        if len(set(req.blocks)) != len(req.blocks):
            return False
        for tier, block in [(TIERS[0], b) for b in req.blocks] + req.swap_blocks:
            if block >= bm.total(tier) or bm.is_free(tier, block):
                return False
            if block in owned[tier] and not (
                tier == TIERS[0] and (block in cache or owned[tier][block] == req.group and req.group)
            ):
                return False
            owned[tier][block] = req.group
    if len(set(cache.values())) != len(cache) or any(b >= bm.total(TIERS[0]) for b in cache):
        return False
    return all(len(owned[t]) + bm.num_free(t) == bm.total(t) for t in TIERS)


def restore(
    snap: Snapshot, totals: tuple[int, ...], config: SchedulerConfig, block_size: int, applied_seq: int = 0
) -> Restored:
    """The scheduler of an executor whose pools have ``totals`` blocks per tier.

    Requests a loop claimed but never committed as admitted go back to the queue;
    cancelled ones finish. Every request goes back to the queue for recompute,
    and the pool starts empty (``reset``), if the recorded pool is not this one,
    if block ownership is inconsistent, or if the executor has executed plans
    built on writes Redis no longer has (``applied_seq`` past ``snap.seq``: a
    restart lost them, and the KV may hold what those writes recorded, e.g.
    blocks that moved to other requests), or if Redis records the swaps or
    copies of a plan the executor never started (``applied_seq`` below
    ``snap.moving``: the KV is not where the state says), or if it ran a plan
    built on the very writes Redis has whose own commit never landed
    (``applied_seq`` equal to ``snap.seq``).
    """
    caching = config.enable_prefix_caching
    # Lends end with their leader: its executor forgets them at this leader's first plan (a reset), so
    # their blocks are free again (and written so by the first commit).
    lent = [[b for t, b in snap.lent if t == tier and b < total] for tier, total in zip(TIERS, totals)]
    pools = [
        Pool.with_free(total, sorted({b for b in free if b < total} | set(back)))
        for total, free, back in zip(totals, snap.free, lent)
    ]
    bm = BlockManager(block_size, *pools, caching=caching)
    for tier, back in zip(TIERS, lent):
        bm.changed[tier].update(back)
    held = [r for r, _ in snap.requests if r.status in (Status.RUNNING, Status.SWAPPED)]
    reset = (
        snap.pool != pool_fields(totals, block_size)
        or not consistent(bm, held, snap.cache)
        or applied_seq > snap.seq
        # The executor ran a plan built on this very state whose commit never landed (a plan that swaps holds
        # the commit after it back while another is in flight): it may have written other requests' KV into
        # blocks Redis says a request still holds (a victim preempted for recompute, an evicted cached block).
        or 0 < applied_seq == snap.seq
        or applied_seq < snap.moving  # the plan whose swaps Redis records never started
    )
    if reset:  # the cache goes too (reset_ops deletes it from Redis)
        bm = BlockManager(block_size, *(Pool.fresh(t) for t in totals), caching=caching)
    else:
        bm.load_cache(snap.cache, snap.ranks)
    sched = Scheduler(config, bm)
    for req, _ in sorted(snap.requests, key=lambda rc: rc[0].arrival):
        if reset or req.status not in (Status.RUNNING, Status.SWAPPED):
            req.blocks, req.swap_blocks, req.num_computed, req.status = [], [], 0, Status.WAITING
        bm.adopt(req)
        sched.add(req)
    sched.relink()
    for req, cancel in snap.requests:
        if cancel is not None:
            sched.finish(req.request_id, cancel)
    sched.requeue_waiting()
    return Restored(sched, reset)


def intake(sched: Scheduler, claimed: list[tuple[Request, Finish | None]], cancels: list[tuple[str, Finish]]) -> None:
    """Apply frontends' cancellations, then take in the requests claimed from the queue."""
    for request_id, reason in cancels:
        sched.finish(request_id, reason)
    for req, cancel in claimed:
        sched.add(req)
        if cancel is not None:
            sched.finish(req.request_id, cancel)
        elif not sched.fits_ever(req):
            sched.requeue(req)  # stale view: some other executor may hold it
