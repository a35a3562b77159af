"""One reader of the loops' events stream per replica, fanned out to the streams it serves.

Loops commit each step's news (tokens with their offsets, finishes) as one
entry of ``{ns}:events``; a replica reads the stream once and routes each
request's part to the queues of the streams following it (a Generate, and any
Resumes of the same request).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from scheduler_svc.state.schema import Event
from scheduler_svc.state.store import UNAVAILABLE, RedisStore

log = logging.getLogger(__name__)
DRAIN = "drain"  # put in every stream's queue when the replica drains
Item = tuple[str, Any]  # ("t", (offset, tokens, logprobs)), ("f", (reason, total, cached)) or (DRAIN, None)


def merge_tokens(items: list[Item]) -> tuple[Item, list[Item]]:
    """The first of ``items`` with the token events queued right behind it merged in, and the rest.

    A stream whose client (or whose write path) lags behind the loop finds several steps' tokens
    queued; sent as one chunk, they cost the frontend and the client one message instead of one per
    step, so the work per stream stops growing with the lag (vLLM's output collector merges a slow
    consumer's deltas the same way). Only contiguous events merge (each starts where the last ended,
    logprobs on all or none): an overlap or gap goes through the stream's own repair."""
    (kind, payload), rest = items[0], items[1:]
    if kind != "t":
        return items[0], rest
    offset, first, first_lps = payload
    tokens, lps = list(first), None if first_lps is None else list(first_lps)
    merged = 0
    for kind, more_payload in rest:
        if kind != "t":  # a finish, or a drain (whose payload is None)
            break
        o, more, more_lps = more_payload
        if o != offset + len(tokens) or (more_lps is None) != (lps is None):
            break
        tokens.extend(more)
        if lps is not None:
            lps.extend(more_lps)
        merged += 1
    return ("t", (offset, tokens, lps)), rest[merged:]


class StreamQueue:
    """One stream's events in order; ``get`` merges the token events queued behind the next one
    into it (``merge_tokens``)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._held: list[Item] = []  # taken from the queue, not yet handed out

    def put_nowait(self, item: Item) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> Item:
        if not self._held:
            self._held.append(await self._queue.get())
        while not self._queue.empty():
            self._held.append(self._queue.get_nowait())
        item, self._held = merge_tokens(self._held)
        return item


class EventBus:
    """Reads the loops' events stream once per replica and routes them by request."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        # Several streams may follow one request (a Generate and Resumes, or a Generate whose
        # duplicate is being refused): each has its own queue, and leaving removes only its
        # own (tests/test_fuzz.py found a refused duplicate silencing the running stream).
        self._queues: dict[str, list[StreamQueue]] = {}
        self.draining = False

    def subscribe(self, request_id: str) -> StreamQueue:
        """A queue of ``request_id``'s events; once the replica drains, one that says so at once."""
        q = StreamQueue()
        if self.draining:
            q.put_nowait((DRAIN, None))
        self._queues.setdefault(request_id, []).append(q)
        return q

    def unsubscribe(self, request_id: str, queue: StreamQueue) -> None:
        queues = self._queues.get(request_id, [])
        if queue in queues:
            queues.remove(queue)
        if not queues:
            self._queues.pop(request_id, None)

    def drain(self) -> None:
        """End every stream, and every one that subscribes from now on: a stream that was past the
        replica's open check but not yet subscribed when the drain began would otherwise run on until
        the server's grace ran out, and end CANCELLED instead of UNAVAILABLE with where to resume."""
        self.draining = True
        for queues in self._queues.values():
            for q in queues:
                q.put_nowait((DRAIN, None))

    async def run(self, stop: asyncio.Event) -> None:
        last = await self.store.events_tail()
        while not stop.is_set():
            try:
                events = await self.store.read_events(last, block_ms=500)
            except UNAVAILABLE as exc:
                log.warning("events stream unavailable (%s); retrying", exc)
                await asyncio.sleep(1)
                continue
            for eid, event in events:
                last = eid
                self._route(event)

    def _route(self, event: Event) -> None:
        for rid, (offset, tokens) in event.tokens.items():
            for q in self._queues.get(rid, ()):
                q.put_nowait(("t", (offset, tokens, event.logprobs.get(rid))))
        for rid, (reason, total) in event.finished.items():
            for q in self._queues.get(rid, ()):
                q.put_nowait(("f", (reason, total, event.cached.get(rid, 0))))
