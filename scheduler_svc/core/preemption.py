"""What a preempted request's KV becomes (``--preemption-mode``): swapped out to the executor's host tiers,
or freed to be recomputed when it resumes. Pure: the scheduler asks, with its blocks and the costs its loop
measured (core/costs.py).

- ``recompute``: always freed (cached blocks stay evictable in the prefix cache).
- ``swap``: copied to the CPU tier, then the disk tier, whenever they have room.
- ``auto`` (the default): copied to the CPU tier when it has room and copying the blocks out and back costs
  less than recomputing their tokens, as this executor measured both (``Costs.swap_pays``); never to disk. On
  a CPU executor the copies are memcpys within one memory (a 512-token request: 9 ms out and back against
  470 ms recomputed, docs/benchmarks.md).
"""

from __future__ import annotations

from scheduler_svc.core.blocks import CPU, BlockManager
from scheduler_svc.core.costs import Costs
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.request import Request

MODES = ("auto", "swap", "recompute")


def swaps(mode: str, victim: Request, blocks: BlockManager, costs: Costs) -> bool:
    """Whether preempting ``victim`` (holding computed tokens) swaps its KV out rather than freeing it."""
    if mode == "swap":
        return blocks.can_swap_out(victim)
    if mode == "auto":
        n = blocks_for(victim.num_computed, blocks.block_size)
        return n <= blocks.num_free(CPU) and costs.swap_pays(n, victim.num_computed)
    return False
