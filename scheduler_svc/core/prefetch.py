"""Blocks pulled from a peer ahead of a request: the reader's side of an ``Offer``.

A peer lends blocks of a prefix (core/migration.py: a request it is about to
move here, pre-copied while it still decodes there, or cached blocks this loop
asked for because a request it holds starts with them). This loop allocates
device blocks for the part of that prefix it does not cache yet, and its next
plan pulls them beside the forward pass (a ``PullPlan`` with no request: a
*fetch*). When the executor reports the pull complete, the blocks are named in
the prefix cache under the hashes the offer carried, so the request finds them
with an ordinary lookup when it is admitted here, and computes only what comes
after. A failed pull frees them unnamed: the request computes what it would
have pulled.

Until then the fetch holds the blocks (one more reference each, as a lend
does on the source), and it keeps holding them named until its request is
admitted here (which takes its own references) or ``FETCH_TTL_MS`` passes, so
the cache cannot evict them before the request they were fetched for arrives.
A block is therefore held by requests, lends or fetches, or free. Redis records
each fetch's blocks beside the lends (``lent``), so a new leader frees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.migration import KvSource

FETCH_TTL_MS = 30_000  # a fetch whose request never came (or came elsewhere) lets its blocks go


def fetch_id(request_id: str) -> str:
    """A fetch's name, in step plans and in the executor's ``lent`` hash (never a lend id: those have a '@')."""
    return f"fetch/{request_id}"


@dataclass(slots=True)
class Fetch:
    request_id: str
    src: KvSource  # the offer's lend
    first: int  # leading blocks of the offer this pool cached already: not pulled
    hashes: list[bytes]  # the names of the pulled blocks, in order
    blocks: list[int]  # the device blocks holding them here (held by the fetch)
    deadline_ms: int
    pulled: bool = False  # reported complete: the blocks are named in the cache
    in_flight: bool = False  # its pull is in a plan whose result is not in: the blocks may be written still

    @property
    def fid(self) -> str:
        return fetch_id(self.request_id)


@dataclass(slots=True)
class Fetches:
    """This pool's fetches, by request id; ``new`` are those the next plan must pull."""

    by_request: dict[str, Fetch] = field(default_factory=dict)
    new: list[Fetch] = field(default_factory=list)

    def add(self, f: Fetch) -> None:
        self.by_request[f.request_id] = f
        self.new.append(f)

    def take(self) -> list[Fetch]:
        new, self.new = self.new, []
        return new

    def pop(self, request_id: str) -> Fetch | None:
        f = self.by_request.pop(request_id, None)
        if f is not None:
            self.new = [x for x in self.new if x is not f]
        return f

    def due(self, now_ms: int) -> list[str]:
        """Request ids whose fetch outlived its deadline (never one whose pull is in flight)."""
        return [rid for rid, f in self.by_request.items() if f.deadline_ms <= now_ms and not f.in_flight]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_request

    def __len__(self) -> int:
        return len(self.by_request)
