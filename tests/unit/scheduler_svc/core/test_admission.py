"""Admission control's retry hint on plain data."""

from __future__ import annotations

from scheduler_svc.core.admission import (
    RETRY_AFTER_DEFAULT_S,
    RETRY_AFTER_MAX_S,
    FinishRate,
    retry_after,
)


def test_retry_after_is_the_time_to_finish_the_excess_at_the_recent_rate() -> None:
    assert retry_after(10, 10, 0.5) == 2, "one request over at 0.5/s: 2 s"
    assert retry_after(10, 10, 4.0) == 1, "never below one second"
    assert retry_after(14, 10, 1.0) == 5, "five must finish (the queue is four over, plus this one)"
    assert retry_after(10, 10, 0.001) == RETRY_AFTER_MAX_S
    for unknown in (None, 0.0, -1.0, float("nan"), float("inf")):
        assert retry_after(10, 10, unknown) == RETRY_AFTER_DEFAULT_S
    assert all(
        isinstance(retry_after(q, 3, r), int) and retry_after(q, 3, r) >= 1
        for q in range(0, 50)
        for r in (None, 0.01, 0.3, 7.0, 1e6)
    )


def test_finish_rate_over_the_window() -> None:
    rate = FinishRate(window_s=10.0)
    assert rate.per_s() is None
    rate.add(0.0, 100)
    rate.add(0.5, 101)
    assert rate.per_s() is None, "half a second says nothing yet"
    for t in range(1, 21):
        rate.add(float(t), 100 + 2 * t)
    assert rate.per_s() == 2.0
    assert rate.samples[0][0] >= 20 - 10 - 1, "old samples leave the window"
    for i in range(100):  # a burst of submissions within one second keeps the sample count small
        rate.add(20.0 + i / 1000, 140)
    assert len(rate.samples) <= 13
    rate.add(30.0, 5)
    assert rate.per_s() is None, "a counter that went back (Redis lost it) starts the samples over"
