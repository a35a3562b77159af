"""How a lagging stream's queued events merge into one chunk: ``merge_tokens`` (pure) and the
``StreamQueue`` a stream reads (an asyncio queue, no Redis)."""

from __future__ import annotations

import asyncio

from scheduler_svc.frontend.bus import DRAIN, StreamQueue, merge_tokens


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
    assert merge_tokens([t(0, [7]), (DRAIN, None)]) == (t(0, [7]), [(DRAIN, None)])  # a drain behind tokens
    assert merge_tokens([t(0, [7])]) == (t(0, [7]), [])


def test_a_stream_queue_hands_out_what_queued_behind_merged() -> None:
    async def go() -> list[tuple]:
        q = StreamQueue()
        for item in (t(0, [1]), t(1, [2]), ("f", ("length", 3, 0))):
            q.put_nowait(item)
        got = [await q.get()]  # the two token events as one, the finish held back
        q.put_nowait(t(3, [4]))
        got += [await q.get(), await q.get()]
        waiter = asyncio.ensure_future(q.get())  # nothing queued: it waits for the next event
        await asyncio.sleep(0)
        q.put_nowait((DRAIN, None))
        return [*got, await waiter]

    assert asyncio.run(go()) == [t(0, [1, 2]), ("f", ("length", 3, 0)), t(3, [4]), (DRAIN, None)]
