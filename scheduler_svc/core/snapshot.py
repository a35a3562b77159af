"""What Redis holds of one executor, as ``RedisStore.load`` reads it and ``restore`` rebuilds from it.

Its own module so that the stores import this plain record without the allocator and scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.request import Finish, Request


@dataclass(slots=True)
class Snapshot:
    """One executor's state as the last commit left it."""

    pool: dict[str, str] = field(default_factory=dict)  # what the free sets were built for
    free: tuple[list[int], ...] = ([], [], [])
    requests: list[tuple[Request, Finish | None]] = field(default_factory=list)  # with any pending cancel
    seq: int = 0  # writes of this state so far
    cache: dict[int, bytes] = field(default_factory=dict)  # device block -> hash, every cached block
    ranks: dict[int, int] = field(default_factory=dict)  # evictable cached block -> LRU rank
    lent: list[tuple[int, int]] = field(default_factory=list)  # (tier, block) of every lend (core/migration.py)
    moving: int = 0  # the seq of a plan whose swaps or copies this state records before its result (0: none)
