"""Block accounting for the device pool and the CPU and disk swap tiers.

Swap-tier blocks are free or owned by exactly one request. Device blocks are
reference-counted for automatic prefix caching (``core/prefix.py`` names a
full block by a hash chained over its prefix): a block is

- free (plain, on a stack: recently freed blocks are reused first),
- cached and evictable: no holder, but it keeps its hash and KV and sits in an
  LRU queue (``lru``) until its memory is needed; a request whose prefix
  matches takes it back,
- or held by one or more requests, ``refs[b]`` of them.

A parallel-sampling group shares its prompt the same way (``fork``), cached
or not; the partial block after the shared ones is copied on write.

Allocation takes plain free blocks first, then evicts the least recently
freed cached block (dropping its hash), so cached blocks are reclaimed before
anyone is preempted: both count in ``num_free``. A request frees its blocks
last to first, so a prefix's tail is evicted before its head.

The manager records which blocks changed state since the last
``take_changes`` (and which hashes came or went) so that a step's commit
writes only those to Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedserve.tiers import TIERS, BlockMove, Tier  # noqa: F401 (TIERS is re-exported)
from scheduler_svc.core import prefix
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.record import CacheDelta
from scheduler_svc.core.request import Request

DEVICE, CPU, DISK = Tier.DEVICE, Tier.CPU, Tier.DISK


@dataclass(slots=True)
class Pool:
    total: int
    free: list[int] = field(default_factory=list)  # a stack: recently freed blocks are reused first
    is_free: bytearray = field(default_factory=bytearray)  # no holder (device: plain free or cached-evictable)

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
    def __init__(
        self, block_size: int, device: Pool, cpu: Pool | None = None, disk: Pool | None = None, *, caching: bool = False
    ) -> None:
        self.block_size = block_size
        self.pools = (device, cpu or Pool.fresh(0), disk or Pool.fresh(0))
        self.caching = caching  # --enable-prefix-caching
        self.refs = [0] * device.total  # holders of each device block
        self.hash_of: dict[int, bytes] = {}  # device block -> its hash, while cached (held or evictable)
        self.cached: dict[bytes, int] = {}  # hash -> the one block holding it
        self.lru: OrderedDict[int, int] = OrderedDict()  # evictable cached block -> rank, oldest first
        self._tick = 0  # the next LRU rank
        self.changed: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        self._rehashed: set[bytes] = set()  # hashes cached or dropped since the last take_changes
        self._track = caching  # write cache state to Redis (also to purge it once caching is turned off)
        # Sources of swaps in the current plan: owned by no request, reusable only
        # once the executor has reported the copies done (``release_pending``).
        self.pending: list[tuple[Tier, int]] = []
        self._pending_dev: set[int] = set()

    def load_cache(self, hashes: dict[int, bytes], ranks: dict[int, int]) -> None:
        """Take over the cache a previous leader left in Redis: block -> hash for every cached
        block, LRU ranks of the evictable ones. Call before ``adopt``ing the live requests."""
        pool = self.pools[DEVICE]
        if not self.caching:  # turned off since: forget it, and purge it from Redis
            self._track = bool(hashes) or self.caching
            self.changed[DEVICE].update(hashes)
            self._rehashed.update(hashes.values())
            return
        for b, h in hashes.items():
            if b < pool.total and h not in self.cached:
                self.hash_of[b], self.cached[h] = h, b
        evictable = sorted((ranks.get(b, 0), b) for b in self.hash_of if pool.is_free[b])
        pool.free = [b for b in pool.free if b not in self.hash_of]
        for rank, b in evictable:
            self.lru[b] = rank
        self._tick = max((r for r, _ in evictable), default=-1) + 1

    def adopt(self, req: Request) -> None:
        """A live request reloaded from Redis holds its device blocks again."""
        for b in req.blocks:
            self.refs[b] += 1

    # -- queries --------------------------------------------------------------

    def num_free(self, tier: Tier = DEVICE) -> int:
        """Blocks an allocation can take: on the device, plain free and cached-evictable."""
        n = len(self.pools[tier].free)
        return n + len(self.lru) if tier == DEVICE else n

    def num_evictable(self) -> int:
        return len(self.lru)

    def num_free_soon(self, tier: Tier = DEVICE) -> int:
        """Free now, plus sources of this plan's swaps that come free after the step."""
        soon = sum(1 for t, b in self.pending if t == tier and (t != DEVICE or self.refs[b] == 0))
        return self.num_free(tier) + soon

    def total(self, tier: Tier = DEVICE) -> int:
        return self.pools[tier].total

    def is_free(self, tier: Tier, block: int) -> bool:
        return bool(self.pools[tier].is_free[block])

    def needed(self, req: Request, num_new: int) -> int:
        """Device blocks ``req`` must gain to hold ``num_new`` more tokens."""
        return max(0, blocks_for(req.num_computed + num_new, self.block_size) - len(req.blocks))

    def can_append(self, req: Request, num_new: int, reserve: int = 0) -> bool:
        return self.needed(req, num_new) + reserve <= self.num_free(DEVICE)

    def can_swap_out(self, req: Request) -> bool:
        return blocks_for(req.num_computed, self.block_size) <= self.num_free(CPU) + self.num_free(DISK)

    def can_swap_in(self, req: Request, num_new: int, reserve: int = 0) -> bool:
        need = blocks_for(req.num_computed + num_new, self.block_size)
        return need + reserve <= self.num_free(DEVICE)

    # -- the prefix cache ---------------------------------------------------------

    def hashes(self, req: Request, upto: int) -> list[bytes]:
        """``req``'s block hash chain, extended to ``upto`` full blocks (its tokens must reach that far)."""
        return self._hashes(req, upto)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The device blocks caching ``hashes``, from the first on, up to the first one not cached here."""
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def _hashes(self, req: Request, upto: int) -> list[bytes]:
        """``req``'s block hash chain, extended to ``upto`` full blocks."""
        hs, bs = req.block_hashes, self.block_size
        parent = hs[-1] if hs else prefix.root(req.cache_salt, req.adapter_digest)
        for i in range(len(hs), upto):
            parent = prefix.block_hash(parent, req.tokens(i * bs, (i + 1) * bs))
            hs.append(parent)
        return hs

    def lookup(self, req: Request) -> list[int]:
        """The cached blocks holding ``req``'s longest cached prefix (full blocks, never all of
        its tokens). Only for a request that holds nothing yet."""
        if not self.caching or req.blocks or req.num_computed:
            return []
        # A request that wants prompt logprobs computes its whole prompt (vLLM skips the cache for it).
        if req.params.prompt_logprobs is not None:
            return []
        hit: list[int] = []
        for h in self._hashes(req, prefix.lookup_limit(req.num_tokens, self.block_size)):
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def can_allocate(self, req: Request, hit: list[int], num_new: int, reserve: int = 0) -> bool:
        """Whether ``req`` can take the cached ``hit`` blocks and room for ``num_new`` tokens after them
        (taking an evictable block back costs a free block, as a new one does)."""
        start = len(hit) * self.block_size
        new = blocks_for(start + num_new, self.block_size) - len(hit)
        return new + sum(1 for b in hit if b in self.lru) + reserve <= self.num_free(DEVICE)

    def allocate(self, req: Request, hit: list[int], num_new: int) -> list[int]:
        """``req`` (holding nothing) takes the ``hit`` prefix, computed already, and room for ``num_new``
        tokens after it; returns the new blocks."""
        for b in hit:
            self._hold(b)
        req.blocks = list(hit)
        req.num_computed = len(hit) * self.block_size
        req.num_registered = len(hit)
        return self.append(req, num_new)

    def cache(self, req: Request, computed: int | None = None) -> None:
        """Name ``req``'s full blocks among its first ``computed`` tokens (default: all it has
        computed) in the cache, after the step that wrote them reported: with a later plan in flight,
        ``num_computed`` counts tokens whose KV is not written yet, and the last one's id is unknown.
        A block whose hash another block already holds (computed at the same time) stays unnamed."""
        if not self.caching:
            return
        done = req.num_computed if computed is None else min(computed, req.num_computed)
        full = min(done // self.block_size, len(req.blocks))
        if full <= req.num_registered:
            return
        hashes = self._hashes(req, full)
        for i in range(req.num_registered, full):
            b, h = req.blocks[i], hashes[i]
            if b in self.hash_of or h in self.cached:
                continue
            self.hash_of[b], self.cached[h] = h, b
            self.changed[DEVICE].add(b)
            self._rehashed.add(h)
        req.num_registered = full

    # -- blocks that move between executors (core/migration.py, core/prefetch.py) -----

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each of these device blocks (a lend of blocks that stay in use here, or a
        fetch keeping its prefix): an evictable cached block stops being evictable."""
        for b in blocks:
            self._hold(b)

    def reserve(self, n: int) -> list[int]:
        """``n`` device blocks, each held once, for a fetch to pull into (evicting cached ones if need be)."""
        return self._alloc(n)

    def release(self, blocks: list[int]) -> None:
        """Drop one hold of each (``hold``, ``reserve``): unheld named blocks become evictable."""
        self._unref(blocks)

    def name(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Name pulled blocks in the cache, in order (a hash cached meanwhile keeps its block, and this
        one stays unnamed)."""
        if not self.caching:
            return
        for b, h in zip(blocks, hashes):
            if b in self.hash_of or h in self.cached:
                continue
            self.hash_of[b], self.cached[h] = h, b
            self.changed[DEVICE].add(b)
            self._rehashed.add(h)

    # -- sharing within a parallel-sampling group -------------------------------

    def fork_cost(self, upto: int) -> int:
        """Device blocks ``fork`` takes at once: one for the copy of a partial block."""
        return 1 if upto % self.block_size else 0

    def fork(self, src: Request, dst: Request, upto: int) -> BlockMove | None:
        """``dst`` (holding nothing, same prompt) takes ``src``'s KV of its first ``upto`` tokens: the
        full blocks among them by reference, the partial one as a copy made by the next plan before
        its forward (copy on write: each goes on writing its own tokens there). Returns that copy;
        its source stays held until the plan that copies is reported (``release_copies``)."""
        full = upto // self.block_size
        for b in src.blocks[:full]:
            self._hold(b)
        dst.blocks = src.blocks[:full]
        dst.num_computed = upto
        dst.block_hashes = src.block_hashes[:full]
        dst.num_registered = min(src.num_registered, full)
        if upto % self.block_size == 0:
            return None
        self._hold(src.blocks[full])
        copy = BlockMove(DEVICE, src.blocks[full], DEVICE, self._alloc(1)[0])
        dst.blocks.append(copy.dst)
        return copy

    def release_copies(self, copies: list[BlockMove]) -> None:
        """The plan that made these copies was reported (or dropped them): their sources come free."""
        self._unref([m.src for m in copies])

    def _hold(self, b: int) -> None:
        if self.refs[b] == 0 and b in self.lru:
            del self.lru[b]
            self.pools[DEVICE].is_free[b] = 0
            self.changed[DEVICE].add(b)
        self.refs[b] += 1

    def _park(self, b: int) -> None:
        """A device block nobody holds any more: evictable if cached, else plain free."""
        pool = self.pools[DEVICE]
        if pool.is_free[b]:
            raise AssertionError(f"device block {b} freed twice")
        pool.is_free[b] = 1
        if b in self.hash_of:
            self.lru[b] = self._tick
            self._tick += 1
        else:
            pool.free.append(b)
        self.changed[DEVICE].add(b)

    def _unref(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # the tail of a prefix is evicted before its head
            if self.refs[b] <= 0:
                raise AssertionError(f"device block {b} freed twice")
            self.refs[b] -= 1
            if self.refs[b] == 0 and b not in self._pending_dev:
                self._park(b)

    def _alloc(self, n: int) -> list[int]:
        pool = self.pools[DEVICE]
        if n > self.num_free(DEVICE):
            raise AssertionError(f"{n} device blocks asked for, {self.num_free(DEVICE)} free")
        taken = []
        for _ in range(n):
            if pool.free:
                b = pool.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)  # evict the least recently freed cached block
                h = self.hash_of.pop(b)
                del self.cached[h]
                self._rehashed.add(h)
            pool.is_free[b] = 0
            self.refs[b] = 1
            taken.append(b)
        self.changed[DEVICE].update(taken)
        return taken

    # -- transitions ----------------------------------------------------------

    def _take(self, tier: Tier, n: int) -> list[int]:
        if tier == DEVICE:
            return self._alloc(n)
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
        need = self.needed(req, num_new)
        if not need:  # most decode steps: room left in its last block
            return []
        new = self._alloc(need)
        req.blocks.extend(new)
        return new

    def trim(self, req: Request, num_tokens: int) -> list[int]:
        """Drop ``req``'s device blocks past those holding its first ``num_tokens`` positions (blocks
        reserved for drafts the executor rejected); returns them. Named blocks are never among them:
        the cache names only blocks of computed tokens."""
        keep = blocks_for(num_tokens, self.block_size)
        extra = req.blocks[keep:]
        if extra:
            del req.blocks[keep:]
            req.num_registered = min(req.num_registered, keep)
            req.table_cuts += 1
            self._unref(extra)
        return extra

    def free(self, req: Request) -> None:
        """Drop every block ``req`` holds, on any tier (shared device blocks stay with their other holders)."""
        self._unref(req.blocks)
        req.blocks = []
        req.num_registered = 0
        for tier in (CPU, DISK):
            self._give(tier, [b for t, b in req.swap_blocks if t == tier])
        req.swap_blocks = []

    def lend(self, req: Request) -> list[tuple[Tier, int]]:
        """``req`` leaves holding nothing while its blocks stay held, by a lend (core/migration.py):
        its device blocks keep their references, its swap blocks stay taken. Returns them, in
        position order."""
        blocks = [(DEVICE, b) for b in req.blocks] + list(req.swap_blocks)
        req.blocks, req.swap_blocks, req.num_registered = [], [], 0
        return blocks

    def unlend(self, blocks: list[tuple[Tier, int]]) -> None:
        """A lend ended: its blocks are released as a request's would be (``free``)."""
        self._unref([b for t, b in blocks if t == DEVICE])
        for tier in (CPU, DISK):
            self._give(tier, [b for t, b in blocks if t == tier])

    def swap_out(self, req: Request) -> list[BlockMove]:
        """BlockMove ``req``'s computed KV to the CPU tier, spilling to disk when it is full.

        Every computed block is copied, shared ones too, so a swapped request is
        self-contained and comes back whatever the cache evicted meanwhile. Blocks
        it held alone stay pending until the copy is reported (then they are free,
        or evictable if cached); shared ones stay on the device with their other
        holders. Device blocks beyond the computed tokens carry nothing and are
        dropped at once.
        """
        keep = blocks_for(req.num_computed, self.block_size)
        n_cpu = min(keep, self.num_free(CPU))
        dst = [(CPU, b) for b in self._take(CPU, n_cpu)] + [(DISK, b) for b in self._take(DISK, keep - n_cpu)]
        moves = [BlockMove(DEVICE, src, tier, b) for src, (tier, b) in zip(req.blocks, dst)]
        for b in req.blocks[:keep]:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.pending.append((DEVICE, b))
                self._pending_dev.add(b)
        self._unref(req.blocks[keep:])
        req.blocks = []
        req.num_registered = 0
        req.swap_blocks = dst
        return moves

    def swap_in(self, req: Request) -> list[BlockMove]:
        """Bring ``req``'s KV back into newly allocated device blocks.

        Its swap blocks stay pending until the copy is reported.
        """
        dst = self._alloc(len(req.swap_blocks))
        moves = [BlockMove(tier, b, DEVICE, d) for (tier, b), d in zip(req.swap_blocks, dst)]
        self.pending.extend(req.swap_blocks)
        req.swap_blocks = []
        req.blocks = dst
        req.num_registered = 0
        return moves

    def release_pending(self, moves: list[BlockMove] | None = None) -> None:
        """The executor reported a step's swaps done: their sources are free (device blocks that
        a prefix hit took meanwhile stay with their new holders). ``moves``: that step's swaps
        (with a later plan already launched, its sources stay pending); None: all."""
        if moves is None:
            done, self.pending = self.pending, []
        else:
            sources = {(m.src_tier, m.src) for m in moves}
            done = [p for p in self.pending if p in sources]
            self.pending = [p for p in self.pending if p not in sources]
        for b in sorted(b for t, b in done if t == DEVICE and b in self._pending_dev):
            self._pending_dev.discard(b)
            if self.refs[b] == 0:
                self._park(b)
        for tier in (CPU, DISK):
            self._give(tier, [b for t, b in done if t == tier])

    def used(self, tier: Tier = DEVICE) -> int:
        return self.total(tier) - self.num_free(tier)

    def take_changes(self) -> tuple[set[int], set[int], set[int]]:
        """Blocks whose free/owned state may have changed since the last call."""
        changed, self.changed = self.changed, (set(), set(), set())
        return changed

    def cache_delta(self, device_changed: set[int]) -> CacheDelta:
        """The cache state of these device blocks and of the hashes cached or dropped since the
        last call, for the commit (empty while caching is and was off)."""
        delta = CacheDelta()
        if not self._track:
            return delta
        for b in device_changed:
            h = self.hash_of.get(b)
            if h is None:
                delta.unhashed.append(b)
            else:
                delta.hashed[b] = h.hex()
            if b in self.lru:
                delta.evictable[b] = self.lru[b]
            else:
                delta.held.append(b)
        for h in self._rehashed:
            (delta.added if h in self.cached else delta.dropped).append(h.hex())
        self._rehashed = set()
        self._track = self.caching
        return delta
