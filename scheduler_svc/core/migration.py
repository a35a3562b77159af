"""KV that moves between executors, the scheduler's side: pure bookkeeping over plain data.

A request leaves a draining executor (the source) for the shared queue *with
its KV*: its blocks move from the request to a **lend** of the source's
scheduler (``Lending``), the request carries a ``KvSource`` naming them, and
the next plan registers the lend with the source executor before the commit
makes the request claimable. Whichever executor claims it (the destination)
allocates blocks for those tokens and plans a **pull**: its executor reads the
lent blocks from the source while its own forward pass runs. Only when the
result says the pull is complete does the request count the tokens as
computed; a failed pull leaves it with what its own prefix cache gave, so it
recomputes the rest like any requeued request. Either way the destination then
asks the source to end the lend (an ``unlend`` doorbell); a lend nobody ends
expires. So a block is held by exactly one of: a request, a lend, the free list.

Blocks can also move *ahead* of a request (``Offer``): a loop lends blocks that
stay held where they are (a running request's full blocks, or cached ones) and
tells one reader to pull them into its own prefix cache (``core/prefetch.py``).
That is how a move is pre-copied (the request keeps decoding while its full
blocks travel; then one short stop lends the rest) and how a peer's cached
prefix serves a request placed elsewhere (``Ask``: the reader asks the holder).

``pick`` chooses which requests migrate, and where: those a serving peer has
room for, by the peers' published views; the rest stay and finish where they
are (or move by recompute at the drain deadline, as before).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.tiers import Tier
from scheduler_svc.core.disagg import DisaggConfig
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.request import Request

DEVICE = Tier.DEVICE
LEND_TTL_MS = 30_000  # a lend nobody ended by then is freed (its reader died, or never came)
OFFER_TTL_MS = 10_000  # an offer's lend: its reader pulls at once or never (then the move goes on without it)
CAUSES = ("drain", "rebalance", "preempt", "disagg", "prefix")  # why blocks moved: metrics label by cause


@dataclass(frozen=True, slots=True)
class MoveConfig:
    """How a replica's loops move KV: ``--migration`` (a drain's moves: kv, recompute or off),
    ``--peer-prefix`` (ask a peer for a cached prefix when pulling it costs less than computing it),
    ``--rebalance`` with ``--rebalance-gap`` and ``--rebalance-every-ms`` (core/rebalance.py), and
    ``--disagg-min-prompt-tokens``/``--disagg-max-prefill-queue`` (core/disagg.py)."""

    migration: str = "kv"
    peer_prefix: bool = True
    rebalance: bool = False
    rebalance_gap: float = 0.25
    rebalance_every_ms: int = 500
    disagg: DisaggConfig = field(default_factory=DisaggConfig)  # prefill and decode executors (core/disagg.py)

    def __post_init__(self) -> None:
        if self.migration not in ("kv", "recompute", "off"):
            raise ValueError(f"migration must be kv, recompute or off, got {self.migration!r}")
        if not 0 < self.rebalance_gap <= 1:
            raise ValueError(f"rebalance_gap must be in (0, 1], got {self.rebalance_gap}")
        if self.rebalance_every_ms < 1:
            raise ValueError(f"rebalance_every_ms must be positive, got {self.rebalance_every_ms}")


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where a queued request's KV can be read from: a lend on another executor."""

    executor: str  # the source's instance id
    address: str  # its host:port
    epoch: int  # the source loop's epoch that lent it
    lend: str  # the lend id
    blocks: tuple[tuple[int, int], ...]  # (tier, block): its block table there, in position order
    tokens: int  # positions [0, tokens) whose KV those blocks hold
    at_ms: int  # when it left the source: the stall a stream sees runs from here to its next token
    cause: str = "drain"
    to: str = ""  # the executor it moves to ('' for any): the one its full blocks were pre-copied to


@dataclass(frozen=True, slots=True)
class Offer:
    """Blocks lent for one reader to pull into its prefix cache ahead of a request: the full blocks of
    a request that keeps running here (pre-copy) or cached ones a reader asked for (a peer prefix hit).
    ``hashes`` names ``src.blocks`` in the cache, in order; no blocks: nothing to lend (the asker stops
    waiting)."""

    to: str  # the reader's instance id
    request_id: str
    src: KvSource  # src.tokens: the positions the prefix covers up to (its last block's end)
    hashes: tuple[str, ...]  # one per block of ``src.blocks``
    start: int = 0  # the prefix block ``src.blocks[0]`` is (the reader caches those before it)
    reserve: int = 0  # blocks the whole prefix will take: the reader holds room for them from the first round


@dataclass(frozen=True, slots=True)
class Ask:
    """A loop holding ``request_id`` asks the executor caching more of its prefix to lend those blocks."""

    to: str  # the holder's instance id
    request_id: str
    reader: str  # the asker's instance id
    hashes: tuple[str, ...]  # the prefix's block hashes from block ``start`` on (it caches those before)
    start: int = 0


@dataclass(slots=True)
class Precopy:
    """A request of this executor whose full blocks a peer is pulling while it keeps running: the lends of
    its rounds not ended yet, and how many of its blocks were offered."""

    request_id: str
    to: str
    cause: str
    lend_ids: list[str] = field(default_factory=list)
    offered: int = 0


@dataclass(slots=True)
class Lent:
    lend_id: str
    request_id: str
    blocks: list[tuple[Tier, int]]
    deadline_ms: int


@dataclass(slots=True)
class PullPlan:
    """One pull in a step plan: ``src.blocks[first:]`` into the destination's ``dst`` blocks, for a
    request this executor runs (``req``) or ahead of one (a fetch, ``core/prefetch.py``: no ``req``)."""

    req: Request | None
    src: KvSource
    first: int  # blocks before it were prefix-cache hits on the destination
    dst: list[int]
    fetch: str = ""  # a fetch's id ('' for a request's own pull)

    @property
    def src_blocks(self) -> tuple[tuple[int, int], ...]:
        return self.src.blocks[self.first : self.first + len(self.dst)]

    @property
    def key(self) -> str:
        """What the executor's report names it by."""
        if self.req is None:
            return self.fetch
        return self.req.request_id


def lend_id(executor: str, epoch: int, request_id: str) -> str:
    return f"{executor}/{epoch}/{request_id}"


@dataclass(slots=True)
class Lending:
    """The source's lends: what holds blocks of requests that left with their KV.

    ``new`` and ``ended`` collect what the next plan must tell the executor (and the next commit
    Redis); ``take`` empties them."""

    lends: dict[str, Lent] = field(default_factory=dict)
    new: list[Lent] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    offers: list[Offer] = field(default_factory=list)  # told to their readers once the plan lending them is sent
    precopies: dict[str, Precopy] = field(default_factory=dict)  # request id -> its pre-copy in progress
    copied: dict[str, Precopy] = field(default_factory=dict)  # pre-copies whose lend ended: stop and move now

    def lend(self, lent: Lent, offer: Offer | None = None) -> None:
        self.lends[lent.lend_id] = lent
        self.new.append(lent)
        if offer is not None:
            self.offers.append(offer)

    def end(self, lend_id: str) -> Lent | None:
        lent = self.lends.pop(lend_id, None)
        if lent is not None:
            self.new = [x for x in self.new if x.lend_id != lend_id]
            self.offers = [o for o in self.offers if o.src.lend != lend_id]
            self.ended.append(lend_id)
            pre = self.precopies.get(lent.request_id)
            if pre is not None and lend_id in pre.lend_ids:
                pre.lend_ids.remove(lend_id)
                if not pre.lend_ids and pre.cause != "disagg":  # a handoff stops at its first token instead
                    self.copied[lent.request_id] = self.precopies.pop(lent.request_id)
        return lent

    def due(self, now_ms: int) -> list[str]:
        return [i for i, x in self.lends.items() if x.deadline_ms <= now_ms]

    def take(self) -> tuple[list[Lent], list[str], list[Offer]]:
        """What the next plan registers and ends, and the offers it makes good (their lends are in it)."""
        new, ended, offers = self.new, self.ended, self.offers
        self.new, self.ended, self.offers = [], [], []
        return new, ended, offers

    def moving(self, request_id: str) -> bool:
        """Whether a pre-copy of ``request_id`` is under way or done (its move comes next)."""
        return request_id in self.precopies or request_id in self.copied

    def forget(self, request_id: str) -> None:
        """``request_id`` left (finished, moved, preempted): no pre-copy of it is waited on any more."""
        self.precopies.pop(request_id, None)
        self.copied.pop(request_id, None)

    @property
    def pending(self) -> bool:
        """Something for the next plan to send."""
        return bool(self.new or self.ended)

    def __len__(self) -> int:
        return len(self.lends)


def movable(req: Request) -> bool:
    """Whether ``req`` can leave with its KV: it holds computed KV of its own and belongs to no
    parallel-sampling group (mates share blocks; a group moves by recompute)."""
    return req.num_computed > 0 and not req.group and req.source is None


def pick(
    candidates: Iterable[Request], views: dict[str, PoolView], me: str, block_size: int
) -> list[tuple[Request, str]]:
    """Of ``candidates`` (most urgent first), those some serving peer has room for now, each with the
    peer with the most room: seats and device blocks above its watermark, each taken from the peer's
    room as it is counted."""
    room = {  # a prefill executor decodes nothing it did not prefill (core/disagg.py): never a destination
        e: [v.max_num_seqs - v.running, v.free[0] - v.watermark]
        for e, v in views.items()
        if e != me and v.serving and v.block_size == block_size and v.role != "prefill"
    }
    out = []
    for req in candidates:
        need = blocks_for(req.num_tokens + 1, block_size)
        for e, (seats, free) in sorted(room.items(), key=lambda kv: (-kv[1][1], kv[0])):
            if seats >= 1 and free >= need and req.num_tokens < views[e].max_model_len:
                room[e] = [seats - 1, free - need]
                out.append((req, e))
                break
    return out


def pull_for(req: Request, hit: list[int], block_size: int) -> int:
    """Tokens a claimed request can take from its ``KvSource`` beyond its own prefix hit (0: none)."""
    src = req.kv
    if src is None or src.tokens > req.num_known or src.tokens <= len(hit) * block_size:
        return 0
    if blocks_for(src.tokens, block_size) > len(src.blocks):
        return 0
    return src.tokens - len(hit) * block_size
