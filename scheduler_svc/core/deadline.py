"""Queue deadlines: which requests have waited past theirs (pure).

A request may carry a deadline (``queue_timeout``, or the client's gRPC
deadline, whichever is earlier) by which it must have *started*. Started means
running now, or having produced a token: a request that is waiting (in the
shared queue, claimed but not admitted, preempted back for recompute) or
swapped out before its first token has not, and expires; a running request
or one whose client has seen a token never does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from scheduler_svc.core.request import Request, Status


def expired(req: Request, now_ms: int) -> bool:
    """Whether ``req`` has waited past its deadline without starting."""
    return (
        req.deadline_ms > 0
        and now_ms >= req.deadline_ms
        and req.status != Status.RUNNING
        and not req.output_ids
        and req.status != Status.FINISHED
    )


def expired_among(requests: Iterable[Request], now_ms: int) -> list[Request]:
    return [r for r in requests if expired(r, now_ms)]


MAX_WAIT_S = 1e9  # about 30 years: a longer timeout is kept as this one (and never overflows)


def deadline_ms(now_ms: int, queue_timeout: float | None, time_remaining: float | None) -> int:
    """The wall-clock deadline (ms) of a request submitted at ``now_ms``: the earlier of its
    ``queue_timeout`` and the call's remaining gRPC time (seconds, None when unset); 0: none."""
    limits = [t for t in (queue_timeout, time_remaining) if t is not None]
    if not limits:
        return 0
    return now_ms + max(1, math.ceil(min(*limits, MAX_WAIT_S) * 1000))
