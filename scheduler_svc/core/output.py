"""What ``Scheduler.schedule()`` decides for one step: the chunks that run (``Scheduled``) and the
blocks that move between tiers, as a ``SchedulerOutput`` the loop turns into a step plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.tiers import BlockMove
from scheduler_svc.core.request import Request

if TYPE_CHECKING:
    from scheduler_svc.core.migration import Lent, PullPlan


@dataclass(slots=True)
class Scheduled:
    req: Request
    start: int  # first position run this step
    num_tokens: int
    # Speculative decoding: proposed tokens run after the request's last one (counted in num_tokens,
    # not in the request's tokens); the executor keeps those its sampler agrees with.
    drafts: list[int] = field(default_factory=list)
    # Whether this chunk reaches the end of the request's tokens, so a token is sampled (fixed when
    # scheduled: launching the step makes that token one more of the request's tokens).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens - len(self.drafts) == self.req.num_tokens

    @property
    def end(self) -> int:
        """The position after the request's own tokens in this chunk (drafts excluded)."""
        return self.start + self.num_tokens - len(self.drafts)


@dataclass(slots=True)
class SchedulerOutput:
    """One step plan: what runs and what moves between tiers."""

    scheduled: list[Scheduled] = field(default_factory=list)
    swap_out: list[BlockMove] = field(default_factory=list)
    swap_in: list[BlockMove] = field(default_factory=list)
    copies: list[BlockMove] = field(default_factory=list)  # copy-on-write of forked group mates, before the forward
    preempted: list[Request] = field(default_factory=list)
    # KV migration (core/migration.py): lends to register and end on this executor, pulls from peers.
    lends: list[Lent] = field(default_factory=list)
    unlends: list[str] = field(default_factory=list)
    pulls: list[PullPlan] = field(default_factory=list)
    launched: bool = False  # ``Scheduler.launch`` ran

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def has_drafts(self) -> bool:
        return any(s.drafts for s in self.scheduled)

    @property
    def has_work(self) -> bool:
        return bool(
            self.scheduled or self.swap_out or self.swap_in or self.copies or self.lends or self.unlends or self.pulls
        )
