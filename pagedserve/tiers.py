"""KV memory tiers, numbered as the executor protocol's ``Tier`` enum on both sides."""

from __future__ import annotations

from enum import IntEnum

from pagedserve.executor.v1 import executor_pb2 as pb


class Tier(IntEnum):
    DEVICE = pb.TIER_DEVICE
    CPU = pb.TIER_CPU
    DISK = pb.TIER_DISK

    @property
    def label(self) -> str:
        return self.name.lower()


TIERS = tuple(Tier)
