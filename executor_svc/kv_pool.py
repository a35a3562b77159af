"""The physical KV pools: device, CPU swap and disk swap tiers.

Every tier has the same layout, ``[layers, num_blocks, block_size, kv_heads,
head_dim]`` for K and for V, so a swap is a block copy between two tensors.
The disk tier is a file-backed tensor (``torch.from_file`` over a file in
``--swap-dir``): its pages live in the file, not in the process heap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V together."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_in(self, num_bytes: float) -> int:
        return max(0, int(num_bytes // self.block_bytes))

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(slots=True)
class Tier:
    """One pool: K and V tensors with the same block numbering."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])


def device_tier(geo: KVGeometry, num_blocks: int, device: torch.device) -> Tier:
    shape = geo.shape(num_blocks)
    return Tier(torch.zeros(shape, dtype=geo.dtype, device=device), torch.zeros(shape, dtype=geo.dtype, device=device))


def cpu_tier(geo: KVGeometry, num_blocks: int, pin: bool) -> Tier:
    """Uninitialised on purpose: a block is only read after a swap-out wrote it, and
    untouched pages of an unpinned tensor cost no memory until then."""
    shape = geo.shape(num_blocks)
    make = lambda: torch.empty(shape, dtype=geo.dtype, pin_memory=pin)  # noqa: E731
    return Tier(make(), make())


def disk_tier(geo: KVGeometry, num_blocks: int, swap_dir: Path) -> Tier:
    """File-backed K and V; the files are unlinked so they vanish with the process."""
    swap_dir.mkdir(parents=True, exist_ok=True)
    shape = geo.shape(num_blocks)
    numel = 1
    for n in shape:
        numel *= n
    tensors = []
    for name in ("k", "v"):
        path = swap_dir / f"pagedserve-swap-{os.getpid()}-{name}.bin"
        t = torch.from_file(str(path), shared=True, size=numel, dtype=geo.dtype).view(shape)
        path.unlink()  # the mapping keeps the pages alive; nothing is left behind on exit
        tensors.append(t)
    return Tier(*tensors)


@dataclass(slots=True)
class KVPool:
    geometry: KVGeometry
    device: Tier
    cpu: Tier | None = None
    disk: Tier | None = None

    def tier(self, index: int) -> Tier:
        """Tier by the protocol's numbering: 0 device, 1 CPU, 2 disk."""
        tier = (self.device, self.cpu, self.disk)[index]
        if tier is None:
            raise ValueError(f"swap tier {index} is not configured on this executor")
        return tier

    def count(self, index: int) -> int:
        tier = (self.device, self.cpu, self.disk)[index]
        return 0 if tier is None else tier.num_blocks
