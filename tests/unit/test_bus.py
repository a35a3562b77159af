"""Pure: how a lagging stream's queued events merge into one chunk (scheduler_svc.bus.merge_tokens)."""

from __future__ import annotations

import asyncio

from scheduler_svc.bus import DRAIN, backlog, merge_tokens


def t(offset: int, tokens: list[int], lps: list[str] | None = None) -> tuple:
    return ("t", (offset, tokens, lps))


def test_contiguous_tokens_merge_up_to_the_finish() -> None:
    finish = ("f", ("length", 5, 0))
    first, rest = merge_tokens([t(0, [7]), t(1, [8, 9]), t(3, [10]), finish, t(4, [11])])
    assert first == t(0, [7, 8, 9, 10]) and rest == [finish, t(4, [11])]


def test_an_overlap_or_a_gap_is_left_to_the_stream_repair() -> None:
    assert merge_tokens([t(0, [7, 8]), t(1, [8, 9])]) == (t(0, [7, 8]), [t(1, [8, 9])])
    assert merge_tokens([t(0, [7]), t(3, [9])]) == (t(0, [7]), [t(3, [9])])


def test_logprobs_merge_only_when_every_event_has_them() -> None:
    assert merge_tokens([t(0, [7], ["a"]), t(1, [8], ["b"])]) == (t(0, [7, 8], ["a", "b"]), [])
    assert merge_tokens([t(0, [7], ["a"]), t(1, [8])]) == (t(0, [7], ["a"]), [t(1, [8])])


def test_other_events_pass_alone() -> None:
    assert merge_tokens([(DRAIN, None), t(0, [7])]) == ((DRAIN, None), [t(0, [7])])
    assert merge_tokens([t(0, [7])]) == (t(0, [7]), [])


def test_backlog_takes_what_is_queued_without_waiting() -> None:
    q: asyncio.Queue = asyncio.Queue()
    assert backlog(q) == []
    for item in (t(0, [1]), t(1, [2])):
        q.put_nowait(item)
    assert backlog(q) == [t(0, [1]), t(1, [2])] and q.empty()
