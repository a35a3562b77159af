"""KV memory tiers, numbered as the executor protocol's ``Tier`` enum on both sides."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import cast

from pagedserve.executor.v1 import executor_pb2 as pb


class Tier(IntEnum):
    DEVICE = pb.TIER_DEVICE
    CPU = pb.TIER_CPU
    DISK = pb.TIER_DISK

    @property
    def label(self) -> str:
        return self.name.lower()

    def to_pb(self) -> pb.Tier:
        """The same number, typed as the protocol's enum (the generated stubs type it apart from ints)."""
        return cast(pb.Tier, int(self))


TIERS = tuple(Tier)


@dataclass(frozen=True, slots=True)
class BlockMove:
    """One KV block copied from ``(src_tier, src)`` to ``(dst_tier, dst)``: a swap or a fork's copy, as the
    scheduler plans it and the executor performs it (the protocol's ``BlockMove``)."""

    src_tier: Tier
    src: int
    dst_tier: Tier
    dst: int
