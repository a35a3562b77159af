"""Which running requests leave a serving executor with their KV, where to, and why (``--rebalance``).

Two causes, checked by each loop at most every ``--rebalance-every-ms``
against the pools' published views:

- **preempt**: the pool is about to preempt. A decoding request takes a new
  block every ``block_size`` tokens; when the free device blocks (above the
  watermark) are fewer than the running requests, some request will find none
  within a block's worth of steps and the scheduler would preempt the least
  urgent one (recompute or swap). Instead, those same requests move now, while
  a peer has room, by the scheduler's own victim order, until the shortfall is
  covered: a move keeps every computed token, a recompute loses them all.
- **rebalance**: the pool's device usage exceeds the least loaded peer's by
  more than ``gap``. Requests move to that peer, victim order first, until the
  projected difference is below half the gap (so the move cannot flip the
  imbalance and start a move back).

Which requests, and why those:
- victim order (under FCFS the latest admitted, under priority the least
  urgent): they are the ones preemption would take first, so the most urgent
  work is never the one that stalls for a move;
- only requests with KV of their own worth moving (at least one full block
  computed), that run alone (no parallel-sampling group: its mates share
  blocks), and that have more than a block of tokens left to generate (one
  about to finish frees its blocks sooner than a move would).

Moves go through the same path as a drain's: pre-copy, then one short stop
(core/migration.py). This module only decides; it is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.tiers import Tier
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.migration import movable
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.request import Request

REBALANCE_EVERY_MS = 500  # default of --rebalance-every-ms: how often a loop reads the peers' views to decide


@dataclass(frozen=True, slots=True)
class Move:
    req: Request
    to: str
    cause: str  # "preempt" | "rebalance"


def worth_moving(req: Request, block_size: int) -> bool:
    left = req.params.max_tokens - len(req.output_ids)
    return movable(req) and not req.pulling and req.num_computed >= block_size and left > block_size


def _room(v: PoolView) -> int:
    return v.free[Tier.DEVICE] - v.watermark


def pick(victims: list[Request], mine: PoolView, views: dict[str, PoolView], gap: float, block_size: int) -> list[Move]:
    """The moves this pool should make now. ``victims``: its running requests in victim order (first the
    one preemption would take first), those already moving left out; ``mine``: its own view, fresh."""
    peers = {
        e: v
        for e, v in views.items()
        if e != mine.executor
        and v.serving
        and v.block_size == block_size
        and v.blocks[Tier.DEVICE]
        and v.role != "prefill"  # decodes nothing it did not prefill (core/disagg.py)
    }
    if not peers or not mine.blocks[Tier.DEVICE]:
        return []
    room = {  # seats, device blocks free above the watermark, device blocks used
        e: [v.max_num_seqs - v.running, _room(v), v.blocks[Tier.DEVICE] - v.free[Tier.DEVICE]] for e, v in peers.items()
    }
    total = mine.blocks[Tier.DEVICE]
    used = total - mine.free[Tier.DEVICE]
    shortfall = mine.running - _room(mine)
    out: list[Move] = []
    bar = gap  # to start moving for balance; once moving, until the gap is half that
    for req in victims:
        if not worth_moving(req, block_size):
            continue
        need = blocks_for(req.num_tokens + block_size, block_size)  # its KV, and a block to grow into
        fits = [e for e, (seats, free, _) in room.items() if seats >= 1 and free >= need]
        if not fits:
            continue
        if shortfall > 0:
            to, cause = max(fits, key=lambda e: (room[e][1], e)), "preempt"
        else:
            to = min(fits, key=lambda e: (room[e][2] / peers[e].blocks[Tier.DEVICE], e))
            if used / total - room[to][2] / peers[to].blocks[Tier.DEVICE] <= bar:
                continue
            after = (used - len(req.blocks)) / total - (room[to][2] + need) / peers[to].blocks[Tier.DEVICE]
            if after < -gap / 2:
                continue  # moving it would flip the imbalance
            cause, bar = "rebalance", gap / 2
        out.append(Move(req, to, cause))
        room[to][0] -= 1
        room[to][1] -= need
        room[to][2] += need
        used -= len(req.blocks)
        shortfall -= len(req.blocks)
    return out
