"""How a lagging stream's queued events merge into one chunk: ``merge_tokens`` (pure) and the
``StreamQueue`` a stream reads (an asyncio queue, no Redis); and how a drain reaches every stream
(``EventBus`` routing only: its Redis reader is not started)."""

from __future__ import annotations

import asyncio
from typing import cast

from scheduler_svc.frontend.bus import DRAIN, EventBus, StreamQueue, merge_tokens
from scheduler_svc.state.store import RedisStore


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


def test_a_drain_ends_open_streams_and_those_that_subscribe_after_it() -> None:
    async def go() -> None:
        bus = EventBus(cast(RedisStore, None))
        before = bus.subscribe("a")
        bus.drain()
        after = bus.subscribe("b")  # a stream past the open check when the drain began
        assert await asyncio.wait_for(before.get(), 1) == (DRAIN, None)
        assert await asyncio.wait_for(after.get(), 1) == (DRAIN, None)

    asyncio.run(go())
