"""Placement: which queued requests an executor's loop should claim this step.

Requests wait in one shared queue in policy order. Every loop with room looks
at the head of the queue and at the other pools (each loop publishes a
``PoolView`` of its own every step) and claims what this function gives it;
the claim itself is atomic in Redis, so a request lands on exactly one
executor even when two loops decide on stale views at once.

The rule walks the queue head in order and assigns each request on paper to
one pool, updating that pool's simulated free blocks, so that one look
spreads a burst over every pool. All loops compute the same assignment from
the same views, so they claim different requests and rarely collide:
- a request goes to the least loaded pool (used fraction of device blocks,
  then executor id) that can hold its next chunk now; a loop whose executor
  runs nothing also takes it when the chosen pool is busy, so an executor
  never idles while a request that fits it waits;
- a request no serving pool could ever hold (its executor left) is skipped: it
  waits for one that fits without blocking the queue;
- the first request that fits nowhere now stops the walk (head-of-line, as
  within one pool); under the priority policy it goes to the pool where
  preempting less urgent work frees enough for the fewest blocks preempted,
  and that pool's loop claims it and preempts.

Prefix-aware: each candidate carries ``hits``, how many of its leading prompt
blocks each executor caches (exact as of each pool's last commit: the peek
script checks the request's block hashes against every executor's set of
cached hashes in Redis). Among the pools that can take it now, the one with
the longest hit wins unless its device usage exceeds the least loaded one's
by more than ``PREFIX_LOAD_BOUND`` (a quarter of the pool): past that, the
prefill a hit saves is worth less than balancing memory, and load wins.

LoRA-aware: each pool publishes ``--max-loras``, the adapters its running and
swapped requests use, and those its executor holds in its device slots. A pool
can take a request on an adapter now only if it runs that adapter or has a free
slot (``core/lora.py``'s rule, with the walk's own assignments counted), so the
request never waits behind another pool's adapters while a slot is free
elsewhere; with no slot anywhere it fits nowhere now and waits at the head of the
queue. Among the pools that can take it, one running its adapter is preferred
(``LORA_RUNNING``), then one whose slots hold it (``LORA_LOADED``: no read, no
copy), then any with a free slot (``LORA_FREE_SLOT``), as a bonus subtracted from
the pool's load (``lora_preference``).

A request moving with its KV (core/migration.py) whose full blocks were
pre-copied to one executor (``target``) goes to that executor whenever it can
take it now: anywhere else it would pull every block again.

With prefill and decode executors (``--role``), a request whose uncached
prompt is long goes to a prefill executor, every other one to the decode and
mixed executors (core/disagg.py).

An extra rule can slot in as ``affinity``: a per-executor bonus subtracted
from a pool's load for one request.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from pagedserve.tiers import Tier
from scheduler_svc.core.disagg import PREFILL, DisaggConfig, split, takes
from scheduler_svc.core.fit import blocks_for, fits_ever

PREFIX_LOAD_BOUND = 0.25  # device usage (0-1) a cache hit may cost over the least loaded pool
LORA_RUNNING = 0.5  # device usage a pool running the request's LoRA adapter may carry over the least loaded
LORA_LOADED = 0.3  # ... one whose device slots hold it (idle) and have room for it
LORA_FREE_SLOT = 0.25  # ... and one with a free adapter slot (it reads and copies the adapter in)


@dataclass(frozen=True, slots=True)
class PoolView:
    """One executor's pool as placement sees it."""

    executor: str
    serving: bool
    block_size: int
    blocks: tuple[int, ...]  # totals per tier
    free: tuple[int, ...]  # free per tier
    running: int
    swapped: int
    max_model_len: int
    max_num_seqs: int
    watermark: int = 0  # device blocks kept free when admitting next to running work
    held: dict[int, int] = field(default_factory=dict)  # priority -> device blocks held by running requests
    max_loras: int = 0  # --max-loras (0: LoRA off)
    adapters: tuple[str, ...] = ()  # digests of the LoRA adapters its running and swapped requests use
    role: str = "mixed"  # its executor's --role (core/disagg.py)
    loaded: tuple[str, ...] = ()  # digests in its executor's device slots (its membership record)

    @property
    def load(self) -> float:
        total = self.blocks[Tier.DEVICE]
        return 1.0 if total == 0 else 1 - self.free[Tier.DEVICE] / total


@dataclass(frozen=True, slots=True)
class Candidate:
    """A queued request, as much as placement needs of it."""

    queue_key: str
    request_id: str
    prompt_len: int
    num_tokens: int  # prompt + tokens generated before it was requeued
    max_tokens: int
    priority: int = 0
    hits: dict[str, int] = field(default_factory=dict)  # executor -> leading prompt blocks it caches
    adapter: str = ""  # its LoRA adapter's digest; '': the base model
    target: str = ""  # the executor its KV was pre-copied to (a move): that one takes it if it can now

    def cached_tokens(self, executor: str, block_size: int) -> int:
        """Tokens of its prefix ``executor`` caches (never all of them: one is always computed)."""
        return min(self.hits.get(executor, 0) * block_size, max(0, self.num_tokens - 1))

    def fits_ever(self, v: PoolView) -> bool:
        return fits_ever(
            self.prompt_len, self.max_tokens, self.num_tokens, v.block_size, v.blocks[Tier.DEVICE], v.max_model_len
        )


@dataclass(slots=True)
class _Sim:
    """A pool while the walk assigns requests to it on paper."""

    view: PoolView
    free: int
    running: int
    adapters: set[str]  # its view's, and those of the requests the walk gave it
    taken: int = 0

    @property
    def load(self) -> float:
        total = self.view.blocks[Tier.DEVICE]
        return 1.0 if total == 0 else 1 - self.free / total

    def need(self, c: Candidate, budget: int) -> int:
        """New blocks its first chunk takes here: a cached prefix costs none (shared with its holders;
        an evictable one counts as free already, so this may overclaim, and the loop requeues)."""
        bs = self.view.block_size
        hit = c.cached_tokens(self.view.executor, bs)
        return blocks_for(hit + min(c.num_tokens - hit, budget), bs) - hit // bs

    def fits_now(self, c: Candidate, budget: int) -> bool:
        reserve = self.view.watermark if self.running else 0
        return self.running < self.view.max_num_seqs and self.need(c, budget) + reserve <= self.free

    def has_slot(self, c: Candidate) -> bool:
        """Whether its adapter could run here now (``core/lora.admits``): the base model, an adapter it
        runs, or a free slot."""
        m = self.view.max_loras
        return not c.adapter or m <= 0 or c.adapter in self.adapters or len(self.adapters) < m

    def assign(self, c: Candidate, budget: int) -> None:
        self.free -= self.need(c, budget)
        self.running += 1
        self.taken += 1
        if c.adapter and self.view.max_loras:
            self.adapters.add(c.adapter)


def preemption_target(c: Candidate, views: list[PoolView], budget: int) -> str | None:
    """Where preempting work less urgent than ``c`` frees enough for it at the least cost:
    fewest blocks preempted, then the least urgent victims, then the executor id."""
    options = []
    for v in views:
        need = blocks_for(min(c.num_tokens, budget), v.block_size)
        lower = {p: n for p, n in v.held.items() if p > c.priority}
        if v.free[Tier.DEVICE] + sum(lower.values()) >= need + (v.watermark if v.running else 0):
            cost = max(0, need - v.free[Tier.DEVICE])
            options.append((cost, -max(lower, default=c.priority), v.executor))
    return min(options)[2] if options else None


def _cache_holder(c: Candidate, now: list[_Sim], least: _Sim) -> _Sim | None:
    """The pool caching ``c``'s longest prefix, unless it is loaded past the bound or holds no
    more of it than the least loaded pool does."""
    if not c.hits:
        return None
    top = max(now, key=lambda s: (c.hits.get(s.view.executor, 0), -s.load, s.view.executor))
    n = c.hits.get(top.view.executor, 0)
    if n <= c.hits.get(least.view.executor, 0) or top.load - least.load > PREFIX_LOAD_BOUND:
        return None
    return top


def lora_preference(c: Candidate, view: PoolView, running: Collection[str] | None = None) -> float:
    """A LoRA request's bonus for a pool: most where its adapter runs (no slot taken), then where it
    sits in a device slot and a slot is free (nothing to read or copy), less where a slot is free;
    none without one, and none for the base model or a pool without LoRA (nothing changes then).
    ``running``: the adapters the pool runs (default: its view's; the walk adds its own assignments)."""
    if not c.adapter or not view.max_loras:
        return 0.0
    running = view.adapters if running is None else running
    if c.adapter in running:
        return LORA_RUNNING
    if len(running) >= view.max_loras:
        return 0.0
    return LORA_LOADED if c.adapter in view.loaded else LORA_FREE_SLOT


PEEK_DEPTH = 64  # queued requests placement looks at per step, at most


def peek_depth(seats: int, pools: int) -> int:
    """How much of the queue's head a look reads. Placement takes candidates in order until one fits
    nowhere now, and each one it places takes a seat somewhere: with ``seats`` free here and about as
    many on each of ``pools`` serving pools, it never reads further (a deeper read is parsed for
    nothing: with a full pool, every step looked at 64 requests to place none)."""
    return max(1, min(PEEK_DEPTH, seats * max(1, pools) + 1))


def pick(
    candidates: list[Candidate],
    me: str,
    views: dict[str, PoolView],
    *,
    policy: str,
    seats: int,
    budget: int,
    affinity: Callable[[Candidate, str], float] | None = None,
    disagg: DisaggConfig | None = None,
) -> list[Candidate]:
    """The candidates (in queue order) that executor ``me`` should claim now.

    ``views`` has every pool that may take work, ``me`` included and fresh;
    ``seats`` and ``budget`` are the sequences and tokens ``me`` can still admit
    this step. ``affinity(c, executor)`` (0 by default) lowers a pool's
    effective load for ``c``, e.g. by the share of ``c``'s prefix it caches.
    ``disagg``: with prefill and decode executors, which pools may take each
    request (core/disagg.py).
    """
    if me not in views or not views[me].serving:
        return []
    sims = {e: _Sim(v, v.free[Tier.DEVICE], v.running, set(v.adapters)) for e, v in views.items() if v.serving}
    mine: list[Candidate] = []
    tokens = budget
    decode_serving = any(s.view.role != PREFILL for s in sims.values())
    for c in candidates:
        d = disagg is not None and split(c, [(s.view, s.running) for s in sims.values()], disagg)
        able = [s for s in sims.values() if c.fits_ever(s.view) and takes(s.view.role, d, decode_serving)]
        if not able:
            continue
        now = [s for s in able if s.fits_now(c, budget) and s.has_slot(c)]
        if not now:
            if policy == "priority" and preemption_target(c, [s.view for s in able], budget) == me:
                mine.append(c)
            break

        def load(s: _Sim, c: Candidate = c) -> tuple[float, str]:
            bonus = (affinity(c, s.view.executor) if affinity else 0.0) + lora_preference(c, s.view, s.adapters)
            return (s.load - bonus, s.view.executor)

        best = min(now, key=load)
        cached = _cache_holder(c, now, best)
        own = sims[me]
        target = sims.get(c.target)
        if target is not None and target in now:
            best = target
        elif cached is not None:
            best = cached
        elif own in now and own.running == 0 and best.running > 0:
            best = own  # idle here, busy there: do not let it wait
        best.assign(c, budget)
        if best is own:
            mine.append(c)
            tokens -= min(c.num_tokens - c.cached_tokens(me, own.view.block_size), tokens)
            if len(mine) >= seats or tokens <= 0:
                break
    return mine
