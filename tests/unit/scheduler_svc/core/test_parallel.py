"""``scheduler_svc.core.parallel`` on plain data: a request's completions, and merging their streams
(asyncio generators stand in for the attached streams)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from scheduler_svc.core import parallel
from scheduler_svc.core.request import Params, Request


def test_completions_take_seed_plus_index_and_only_the_first_asks_for_prompt_logprobs() -> None:
    req = Request("r", [5, 6, 7], Params(n=3, seed=(1 << 64) - 2, prompt_logprobs=2), priority=4, cache_salt="s")
    got = parallel.completions(req)
    assert [c.request_id for c in got] == ["r#0", "r#1", "r#2"]
    assert [c.params.seed for c in got] == [(1 << 64) - 2, (1 << 64) - 1, 0], "seeds wrap as a uint64"
    assert [c.params.prompt_logprobs for c in got] == [2, None, None]
    assert all((c.group, c.index, c.priority, c.cache_salt) == ("r", i, 4, "s") for i, c in enumerate(got))
    got[0].prompt_ids.append(8)
    assert got[1].prompt_ids == [5, 6, 7], "each completion has its own lists"
    assert parallel.completions(Request("one", [1], Params()))[0].request_id == "one"


async def _items(name: str, n: int, log: list[str], fail: bool = False) -> AsyncIterator[str]:
    try:
        for i in range(n):
            await asyncio.sleep(0.001)
            yield f"{name}{i}"
        if fail:
            raise RuntimeError(name)
        await asyncio.sleep(0)
    finally:
        log.append(f"closed {name}")


def test_merge_yields_everything_until_every_stream_ends() -> None:
    async def go() -> list[str]:
        log: list[str] = []
        return [x async for x in parallel.merge([_items("a", 3, log), _items("b", 2, log)], log.append)]

    got = asyncio.run(go())
    assert sorted(got) == ["a0", "a1", "a2", "b0", "b1"]
    assert got.index("a0") < got.index("a1") < got.index("a2"), "each stream keeps its order"


def test_the_first_error_is_seen_before_the_other_streams_close_then_raised() -> None:
    async def slow(log: list[str]) -> AsyncIterator[str]:
        try:
            yield "s0"
            await asyncio.sleep(10)
            yield "s1"
        finally:
            log.append("closed slow")

    async def go() -> list[str]:
        log: list[str] = []

        def seen(exc: BaseException) -> None:
            log.append(f"error {exc}")

        with pytest.raises(RuntimeError, match="bad"):
            async for _ in parallel.merge([_items("bad", 1, log, fail=True), slow(log)], seen):
                pass
        return log

    log = asyncio.run(go())
    assert log.index("error bad") < log.index("closed slow")
