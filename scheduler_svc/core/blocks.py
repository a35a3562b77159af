"""Block accounting for the device pool and the CPU and disk swap tiers.

Each tier is a set of numbered blocks, either free or owned by exactly one
request. The manager records which blocks changed state since the last
``take_changes`` so that a step's commit writes only those to Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.tiers import TIERS, Tier
from scheduler_svc.core.request import Request

DEVICE, CPU, DISK = Tier.DEVICE, Tier.CPU, Tier.DISK


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class Move:
    """One block copied from ``(src_tier, src)`` to ``(dst_tier, dst)``."""

    src_tier: Tier
    src: int
    dst_tier: Tier
    dst: int


@dataclass(slots=True)
class Pool:
    total: int
    free: list[int] = field(default_factory=list)  # a stack: recently freed blocks are reused first
    is_free: bytearray = field(default_factory=bytearray)

    @classmethod
    def fresh(cls, total: int) -> Pool:
        return cls(total, list(range(total - 1, -1, -1)), bytearray(b"\x01" * total))

    @classmethod
    def with_free(cls, total: int, free: list[int]) -> Pool:
        flags = bytearray(total)
        for b in free:
            flags[b] = 1
        return cls(total, sorted(free, reverse=True), flags)


class BlockManager:
    def __init__(self, block_size: int, device: Pool, cpu: Pool | None = None, disk: Pool | None = None) -> None:
        self.block_size = block_size
        self.pools = (device, cpu or Pool.fresh(0), disk or Pool.fresh(0))
        self.changed: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        # Sources of swaps in the current plan: owned by no request, reusable only
        # once the executor has reported the copies done (``release_pending``).
        self.pending: list[tuple[Tier, int]] = []

    # -- queries --------------------------------------------------------------

    def num_free(self, tier: Tier = DEVICE) -> int:
        return len(self.pools[tier].free)

    def num_free_soon(self, tier: Tier = DEVICE) -> int:
        """Free now, plus sources of this plan's swaps that come free after the step."""
        return self.num_free(tier) + sum(1 for t, _ in self.pending if t == tier)

    def total(self, tier: Tier = DEVICE) -> int:
        return self.pools[tier].total

    def is_free(self, tier: Tier, block: int) -> bool:
        return bool(self.pools[tier].is_free[block])

    def needed(self, req: Request, num_new: int) -> int:
        """Device blocks ``req`` must gain to hold ``num_new`` more tokens."""
        return max(0, blocks_needed(req.num_computed + num_new, self.block_size) - len(req.blocks))

    def can_append(self, req: Request, num_new: int, reserve: int = 0) -> bool:
        return self.needed(req, num_new) + reserve <= self.num_free(DEVICE)

    def can_swap_out(self, req: Request) -> bool:
        return blocks_needed(req.num_computed, self.block_size) <= self.num_free(CPU) + self.num_free(DISK)

    def can_swap_in(self, req: Request, num_new: int, reserve: int = 0) -> bool:
        need = blocks_needed(req.num_computed + num_new, self.block_size)
        return need + reserve <= self.num_free(DEVICE)

    # -- transitions ----------------------------------------------------------

    def _take(self, tier: Tier, n: int) -> list[int]:
        pool = self.pools[tier]
        taken = [pool.free.pop() for _ in range(n)]
        for b in taken:
            pool.is_free[b] = 0
        self.changed[tier].update(taken)
        return taken

    def _give(self, tier: Tier, blocks: list[int]) -> None:
        pool = self.pools[tier]
        for b in blocks:
            if pool.is_free[b]:
                raise AssertionError(f"{Tier(tier).label} block {b} freed twice")
            pool.is_free[b] = 1
        pool.free.extend(blocks)
        self.changed[tier].update(blocks)

    def append(self, req: Request, num_new: int) -> list[int]:
        """Grow ``req``'s block table to hold ``num_new`` more tokens; returns the new blocks."""
        new = self._take(DEVICE, self.needed(req, num_new))
        req.blocks.extend(new)
        return new

    def free(self, req: Request) -> None:
        """Return every block ``req`` owns, on any tier."""
        self._give(DEVICE, req.blocks)
        req.blocks = []
        for tier in (CPU, DISK):
            self._give(tier, [b for t, b in req.swap_blocks if t == tier])
        req.swap_blocks = []

    def swap_out(self, req: Request) -> list[Move]:
        """Move ``req``'s computed KV to the CPU tier, spilling to disk when it is full.

        Device blocks beyond those holding computed tokens carry nothing and
        are freed at once; the others stay pending until the copy is reported.
        """
        keep = blocks_needed(req.num_computed, self.block_size)
        n_cpu = min(keep, self.num_free(CPU))
        dst = [(CPU, b) for b in self._take(CPU, n_cpu)] + [(DISK, b) for b in self._take(DISK, keep - n_cpu)]
        moves = [Move(DEVICE, src, tier, b) for src, (tier, b) in zip(req.blocks, dst)]
        self.pending.extend((DEVICE, b) for b in req.blocks[:keep])
        self._give(DEVICE, req.blocks[keep:])
        req.blocks = []
        req.swap_blocks = dst
        return moves

    def swap_in(self, req: Request) -> list[Move]:
        """Bring ``req``'s KV back into newly allocated device blocks.

        Its swap blocks stay pending until the copy is reported.
        """
        dst = self._take(DEVICE, len(req.swap_blocks))
        moves = [Move(tier, b, DEVICE, d) for (tier, b), d in zip(req.swap_blocks, dst)]
        self.pending.extend(req.swap_blocks)
        req.swap_blocks = []
        req.blocks = dst
        return moves

    def release_pending(self, moves: list[Move] | None = None) -> None:
        """The executor reported a step's swaps done: their sources are free. ``moves``: that
        step's swaps (with a later plan already launched, its sources stay pending); None: all."""
        if moves is None:
            done, self.pending = self.pending, []
        else:
            sources = {(m.src_tier, m.src) for m in moves}
            done = [p for p in self.pending if p in sources]
            self.pending = [p for p in self.pending if p not in sources]
        for tier in TIERS:
            self._give(tier, [b for t, b in done if t == tier])

    def used(self, tier: Tier = DEVICE) -> int:
        return self.total(tier) - self.num_free(tier)

    def take_changes(self) -> tuple[set[int], set[int], set[int]]:
        """Blocks whose free/owned state may have changed since the last call."""
        changed, self.changed = self.changed, (set(), set(), set())
        return changed
