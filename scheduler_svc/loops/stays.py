"""Each request's stay on one executor, as metrics and traces see it.

A loop tells this what it claimed, what each step ran and what left (finished,
or went back to the queue); it observes ``request_queue_time_seconds`` when a
request first runs, and, when tracing is on, adds to the request's trace a
``pagedserve.queue`` span (submission to first run) and a
``pagedserve.executor`` span (its stay here). Requests a new leader restored
from Redis have no entry: their stay is not traced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry.trace import Tracer
from opentelemetry.util.types import AttributeValue

from pagedserve.tracing import parent
from scheduler_svc.core.output import SchedulerOutput
from scheduler_svc.core.record import StepRecord
from scheduler_svc.metrics import LoopMetrics
from scheduler_svc.state.codec import Claimed


@dataclass(slots=True)
class _Stay:
    submitted_ms: int
    traceparent: str
    first_run: bool  # it never ran anywhere before: its wait counts as queue time
    since_ns: int = 0  # its first step here (wall clock, ns)
    steps: int = 0
    tokens: int = 0


class Placements:
    def __init__(
        self, executor: str, model: str, metrics: LoopMetrics | None = None, tracer: Tracer | None = None
    ) -> None:
        self.executor = executor
        self.model = model
        self.metrics = metrics
        self.tracer = tracer
        self._stays: dict[str, _Stay] = {}

    def claimed(self, claimed: list[Claimed]) -> None:
        for c in claimed:
            first = not c.req.output_ids and c.req.num_preemptions == 0
            self._stays[c.req.request_id] = _Stay(c.submitted_ms, c.traceparent, first)

    def stepped(self, out: SchedulerOutput) -> None:
        now = time.time_ns()
        for x in out.scheduled:
            stay = self._stays.get(x.req.request_id)
            if stay is None:
                continue
            stay.steps += 1
            if stay.since_ns:
                continue
            stay.since_ns = now
            if stay.first_run and stay.submitted_ms:
                if self.metrics is not None:
                    self.metrics.admitted(self.model, self.executor, stay.submitted_ms)
                self._span("pagedserve.queue", x.req.request_id, stay, stay.submitted_ms * 1_000_000, now, {})

    def left(self, rec: StepRecord, now: int) -> None:
        """Requests that finished or went back to the queue in a step whose result came back at `now` (ns).

        `now` is taken before the commit: once committed, the tokens are streamed and the frontend may end
        the request's root span, which must not end before its children.
        """
        for rid, toks in rec.new_tokens.items():
            if (stay := self._stays.get(rid)) is not None:
                stay.tokens += len(toks)
        for req in rec.finished:
            self._leave(
                req.request_id,
                now,
                {
                    "pagedserve.finish_reason": str(req.finish_reason or "abort"),
                    "pagedserve.preemptions": req.num_preemptions,
                },
            )
        for req in rec.requeued:
            self._leave(
                req.request_id, now, {"pagedserve.outcome": "requeued", "pagedserve.preemptions": req.num_preemptions}
            )

    def _leave(self, rid: str, now: int, attrs: dict[str, AttributeValue]) -> None:
        stay = self._stays.pop(rid, None)
        if stay is not None and stay.since_ns:
            attrs = {**attrs, "pagedserve.steps": stay.steps, "pagedserve.tokens": stay.tokens}
            self._span("pagedserve.executor", rid, stay, stay.since_ns, now, attrs)

    def _span(
        self, name: str, rid: str, stay: _Stay, start_ns: int, end_ns: int, attrs: dict[str, AttributeValue]
    ) -> None:
        if self.tracer is None or not stay.traceparent:
            return
        span = self.tracer.start_span(
            name,
            context=parent(stay.traceparent),
            start_time=start_ns,
            attributes={"pagedserve.request_id": rid, "pagedserve.executor": self.executor, **attrs},
        )
        span.end(end_time=end_ns)
