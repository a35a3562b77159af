"""Parallel sampling (``SamplingParams.n``): the n completions of one request.

A request with n > 1 is stored and scheduled as n requests, its completions,
with ids ``<request id>#<index>`` (``completion_id``; the claim script in
``store.py`` builds the same ids). Each has its own tokens, events, logprobs
and finish, so streaming, resuming, a stop string and failover need nothing
new for it; the scheduler knows them as one group (``Request.group``): it
admits and preempts them together and shares their prompt's KV blocks
(``core/scheduler.py``). The frontend submits them in one call, merges their
streams (``merge``), and maps Abort and Resume of the request's id onto them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TypeVar

from scheduler_svc.core.request import Request

T = TypeVar("T")
SEED_MOD = 1 << 64  # sampling.seed is a uint64


def completion_id(group: str, index: int) -> str:
    return f"{group}#{index}"


def completions(req: Request) -> list[Request]:
    """``req`` as the requests the scheduler runs: itself when n is 1, else its n completions.
    Completion i samples with seed + i, and only completion 0 asks for the prompt's logprobs (the
    prompt is the same; the others fork from it without computing them)."""
    p = req.params
    if p.n <= 1:
        return [req]
    out = []
    for i in range(p.n):
        params = replace(
            p,
            seed=None if p.seed is None else (p.seed + i) % SEED_MOD,
            prompt_logprobs=p.prompt_logprobs if i == 0 else None,
        )
        out.append(
            Request(
                completion_id(req.request_id, i),
                list(req.prompt_ids),
                params,
                priority=req.priority,
                deadline_ms=req.deadline_ms,
                cache_salt=req.cache_salt,
                lora=req.lora,
                group=req.request_id,
                index=i,
            )
        )
    return out


async def merge(streams: list[AsyncIterator[T]], on_error: Callable[[BaseException], None]) -> AsyncIterator[T]:
    """The items of all ``streams`` as they come, until every one has ended. The first error ends
    the merge: ``on_error`` sees it before the other streams are closed (their cleanup runs then),
    and it is raised."""
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put(("item", item))
        except Exception as exc:  # handed to the reader; a cancellation is the reader's own doing
            await queue.put(("error", exc))
        else:
            await queue.put(("end", None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            kind, value = await queue.get()
            if kind == "item":
                yield value  # type: ignore[misc]
            elif kind == "end":
                left -= 1
            else:
                assert isinstance(value, BaseException)
                on_error(value)
                raise value
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
