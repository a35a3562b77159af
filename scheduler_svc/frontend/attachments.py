"""Which requests this replica's streams hold, kept fresh in Redis.

A request is *attached* while some stream follows it: the frontend that holds
it refreshes its time in ``{ns}:attached`` every few seconds, and any
replica's manager aborts a request nobody has refreshed for
``--detach-timeout`` (``RedisStore.detached``), so a crashed frontend costs at
most that much compute, and a client that resumes within it loses nothing.

The refresh also notices requests Redis no longer knows (it restarted from an
AOF that missed their last second): the frontend still has them and submits
them again, with their stored seed, so they regenerate the same tokens.
"""

from __future__ import annotations

import asyncio
import logging

from scheduler_svc.core.request import Request
from scheduler_svc.state.store import (
    DETACH_TIMEOUT_S,
    UNAVAILABLE,
    DuplicateRequest,
    RedisStore,
)

log = logging.getLogger(__name__)


class Attachments:
    def __init__(self, store: RedisStore, policy: str, detach_timeout: float = DETACH_TIMEOUT_S) -> None:
        self.store = store
        self.policy = policy
        self.interval = max(0.2, min(5.0, detach_timeout / 3))
        self._held: dict[str, tuple[Request, list[str]]] = {}  # request id -> what it was submitted as

    def hold(self, req: Request, stop: list[str]) -> None:
        self._held[req.request_id] = (req, stop)

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    async def touch(self, request_id: str) -> None:
        """Refresh one request now (a resumed stream must not wait for the next round)."""
        await self.store.attach([request_id])

    async def refresh(self) -> None:
        missing = await self.store.attach(list(self._held))
        for rid in missing:
            held = self._held.get(rid)
            if held is None:
                continue
            req, stop = held
            log.warning(
                "%s is gone from Redis (a restart lost its last writes); submitting it again",
                rid,
                extra={"request_id": rid},
            )
            try:
                await self.store.submit(req, stop, self.policy)
            except DuplicateRequest:
                pass  # someone else did meanwhile

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.refresh()
            except UNAVAILABLE as exc:
                log.warning("cannot refresh attachments (%s); retrying", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                pass
