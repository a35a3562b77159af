"""What one step changed: the pure core's account of itself, for the store to persist.

The scheduler fills a ``StepRecord`` as things happen (intake, scheduling,
the executor's result, requeues) and hands it over with ``take_record``;
``scheduler_svc.codec`` turns it into Redis operations and the frontends'
event. Nothing here knows about Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from scheduler_svc.core.request import Request


@dataclass(slots=True)
class Counters:
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    disk_spilled_blocks: int = 0
    steps: int = 0
    generated_tokens: int = 0
    finished: int = 0  # requests that ended here (the finish rate behind admission's retry hint)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def nonzero(self) -> dict[str, int]:
        return {k: v for k, v in self.as_dict().items() if v}


@dataclass(slots=True)
class StepRecord:
    """Everything a step changed. ``changed`` is filled by ``Scheduler.take_record``."""

    touched: dict[str, Request] = field(default_factory=dict)  # status, blocks or num_computed changed
    new_tokens: dict[str, list[int]] = field(default_factory=dict)  # appended to output_ids this step
    # With logprobs: one opaque entry per token of new_tokens (the codec encodes them).
    logprobs: dict[str, list[object]] = field(default_factory=dict)
    prompt_logprobs: dict[str, dict[int, object]] = field(default_factory=dict)  # prompt position -> entry
    finished: list[Request] = field(default_factory=list)
    requeued: list[Request] = field(default_factory=list)  # back to the shared queue, holding nothing
    counters: Counters = field(default_factory=Counters)  # deltas
    changed: tuple[set[int], set[int], set[int]] = field(default_factory=lambda: (set(), set(), set()))

    def touch(self, req: Request) -> None:
        self.touched[req.request_id] = req

    @property
    def empty(self) -> bool:
        return not (self.touched or self.new_tokens or self.finished or self.requeued or any(self.changed)
                    or self.counters.nonzero())
