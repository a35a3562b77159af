"""Admission control's pure part: the retry hint of a refused request.

The limit itself (``--max-pending-requests``) is checked atomically in Redis
by the submit script, against the namespace's whole queue; what is left here
is how long a refused client should wait. A slot opens when a queued request
starts, and in a saturated deployment requests start as fast as others finish,
so the hint is the time for the namespace to finish as many requests as the
queue is over the limit (at least one), at the finish rate of the last
``WINDOW_S`` seconds. It is what an HTTP layer would send as ``Retry-After``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

RETRY_AFTER_DEFAULT_S = 2  # no finish rate known yet (fresh replica, or nothing finished lately)
RETRY_AFTER_MAX_S = 60
WINDOW_S = 30.0
MIN_SPAN_S = 1.0  # samples closer together than this say nothing about a rate
SAMPLE_EVERY_S = 0.5


def retry_after(queued: int, limit: int, finished_per_s: float | None) -> int:
    """Whole seconds (>= 1) to wait before retrying a request refused with ``queued`` waiting."""
    if not finished_per_s or finished_per_s <= 0 or not math.isfinite(finished_per_s):
        return RETRY_AFTER_DEFAULT_S
    over = max(1, queued - limit + 1)
    return max(1, min(RETRY_AFTER_MAX_S, math.ceil(over / finished_per_s)))


@dataclass(slots=True)
class FinishRate:
    """Requests finished per second in the namespace, from samples of its cumulative
    ``finished`` counter (the submit script returns it with every submission)."""

    window_s: float = WINDOW_S
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, t: float, finished: int) -> None:
        if self.samples and finished < self.samples[-1][1]:
            self.samples.clear()  # the counter started over (Redis lost it): old samples mean nothing
        if len(self.samples) >= 2 and t - self.samples[-2][0] < SAMPLE_EVERY_S:
            self.samples[-1] = (t, finished)  # a burst of submissions keeps one sample per half second
        else:
            self.samples.append((t, finished))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()

    def per_s(self) -> float | None:
        """The rate over the window, or None while the samples span less than ``MIN_SPAN_S``."""
        if len(self.samples) < 2:
            return None
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        if t1 - t0 < MIN_SPAN_S:
            return None
        return (c1 - c0) / (t1 - t0)
