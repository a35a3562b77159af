"""KV migration, the scheduler's side: pure bookkeeping over plain data.

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

``pick`` chooses which requests migrate: those a serving peer has room for, by
the peers' published views; the rest stay and finish where they are (or move by
recompute at the drain deadline, as before).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.tiers import Tier
from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.request import Request

DEVICE = Tier.DEVICE
LEND_TTL_MS = 30_000  # a lend nobody ended by then is freed (its reader died, or never came)


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


@dataclass(slots=True)
class Lent:
    lend_id: str
    request_id: str
    blocks: list[tuple[Tier, int]]
    deadline_ms: int


@dataclass(slots=True)
class PullPlan:
    """One pull in a step plan: ``src.blocks[first:]`` into the destination's ``dst`` blocks."""

    req: Request
    src: KvSource
    first: int  # blocks before it were prefix-cache hits on the destination
    dst: list[int]

    @property
    def src_blocks(self) -> tuple[tuple[int, int], ...]:
        return self.src.blocks[self.first : self.first + len(self.dst)]


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

    def lend(self, lent: Lent) -> None:
        self.lends[lent.lend_id] = lent
        self.new.append(lent)

    def end(self, lend_id: str) -> Lent | None:
        lent = self.lends.pop(lend_id, None)
        if lent is not None:
            self.new = [x for x in self.new if x.lend_id != lend_id]
            self.ended.append(lend_id)
        return lent

    def due(self, now_ms: int) -> list[str]:
        return [i for i, x in self.lends.items() if x.deadline_ms <= now_ms]

    def take(self) -> tuple[list[Lent], list[str]]:
        new, ended, self.new, self.ended = self.new, self.ended, [], []
        return new, ended

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


def pick(candidates: Iterable[Request], views: dict[str, PoolView], me: str, block_size: int) -> list[Request]:
    """Of ``candidates`` (most urgent first), those some serving peer has room for now: seats and
    device blocks above its watermark, each taken from the peer's room as it is counted."""
    room = {
        e: [v.max_num_seqs - v.running, v.free[0] - v.watermark]
        for e, v in views.items()
        if e != me and v.serving and v.block_size == block_size
    }
    out = []
    for req in candidates:
        need = blocks_for(req.num_tokens + 1, block_size)
        for e, (seats, free) in sorted(room.items(), key=lambda kv: -kv[1][1]):
            if seats >= 1 and free >= need and req.num_tokens < views[e].max_model_len:
                room[e] = [seats - 1, free - need]
                out.append(req)
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
