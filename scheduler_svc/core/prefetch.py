"""Blocks pulled from a peer ahead of a request: the reader's side of an ``Offer``.

A peer lends blocks of a prefix (core/migration.py): a request it is about to
move here, pre-copied while it still runs there (a drain's or a rebalance's
move, or a prefill executor's prompt, round by round as its chunks complete),
or cached blocks this loop asked for because a request it holds starts with
them. This loop keeps (holds) the offered blocks it caches already, puts the
rest into device blocks of its own, and its next plan pulls them beside the
forward pass (a ``PullPlan`` with no request, keyed ``fetch/<request>/<first
block>``). When the executor reports the pull complete, the blocks are named in
the prefix cache under the hashes the offer carried, so the request finds them
with an ordinary lookup when it is admitted here, and computes only what comes
after. A failed pull leaves its blocks unnamed: the request computes them.

A **fetch** is everything one request has here ahead of it: the blocks it
holds (one more reference each, as a lend does on the source), kept or pulled
or reserved. An offer may ask the reader to **reserve** blocks for the whole
prefix at once (a prefill executor's first round: the decode executor commits
its room before the prompt is computed), and later rounds fill them. A fetch
holds its blocks until its request is admitted here (which takes its own
references), it outlives ``FETCH_TTL_MS``, or its source leaves the views;
never while one of its pulls is in flight. A block is therefore held by
requests, lends or fetches, or free. Redis records each fetch's blocks beside
the lends (``lent``, key ``fetch/<request>``), so a new leader frees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.migration import KvSource

FETCH_TTL_MS = 30_000  # a fetch whose request never came (or came elsewhere) lets its blocks go
PREFIX = "fetch/"


def fetch_id(request_id: str) -> str:
    """A fetch's name in the executor's ``lent`` hash (never a lend id: those have a '@')."""
    return PREFIX + request_id


def pull_key(request_id: str, first: int) -> str:
    """A fetch's pull, in a step plan and its result: the request and the prefix block it starts at."""
    return f"{PREFIX}{request_id}/{first}"


def request_of(key: str) -> str:
    return key.removeprefix(PREFIX).rsplit("/", 1)[0]


def fetch_kind(cause: str) -> str:
    """What a fetch is for, by its offer's cause: ``prefix`` (a peer prefix hit), ``handoff`` (a prefill
    executor's prompt for this decode executor), ``precopy`` (a move's pre-copy: drain, rebalance, preempt)."""
    return cause if cause in ("prefix",) else "handoff" if cause == "disagg" else "precopy"


@dataclass(slots=True)
class Round:
    """One offer's pull, in flight: from ``src.blocks[first:]`` into ``dst``, to be named ``hashes``."""

    key: str
    src: KvSource
    first: int
    dst: list[int]
    hashes: list[bytes]
    planned: bool = False


@dataclass(slots=True)
class Fetch:
    request_id: str
    source: str  # the lending executor: when it leaves the views, nothing more comes
    deadline_ms: int
    blocks: list[int] = field(default_factory=list)  # every device block it holds
    spare: list[int] = field(default_factory=list)  # of which: reserved, not pulled into yet
    rounds: dict[str, Round] = field(default_factory=dict)  # pulls not reported yet
    pulled: bool = False  # some round was reported complete: named blocks wait for the request
    hold_ms: int = 0  # its request, waiting here for room, goes back to the queue from then on

    @property
    def fid(self) -> str:
        return fetch_id(self.request_id)

    @property
    def in_flight(self) -> bool:
        """A pull of it is planned or running: its blocks may still be written."""
        return bool(self.rounds)


@dataclass(slots=True)
class Fetches:
    """This pool's fetches, by request id."""

    by_request: dict[str, Fetch] = field(default_factory=dict)

    def add(self, f: Fetch) -> None:
        self.by_request[f.request_id] = f

    def get(self, request_id: str) -> Fetch | None:
        return self.by_request.get(request_id)

    def take(self) -> list[Round]:
        """Rounds the next plan must pull (each once)."""
        out = [r for f in self.by_request.values() for r in f.rounds.values() if not r.planned]
        for r in out:
            r.planned = True
        return out

    @property
    def new(self) -> bool:
        """Some round waits for a plan."""
        return any(not r.planned for f in self.by_request.values() for r in f.rounds.values())

    def pop(self, request_id: str) -> Fetch | None:
        return self.by_request.pop(request_id, None)

    def due(self, now_ms: int) -> list[str]:
        """Request ids whose fetch outlived its deadline (never one whose pull is in flight)."""
        return [rid for rid, f in self.by_request.items() if f.deadline_ms <= now_ms and not f.in_flight]

    def from_gone(self, present: set[str]) -> list[str]:
        """Request ids whose fetch's source left (reaped: not among ``present``, the executors with a view;
        none in flight): nothing more will come."""
        return [rid for rid, f in self.by_request.items() if f.source not in present and not f.in_flight]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_request

    def __len__(self) -> int:
        return len(self.by_request)
