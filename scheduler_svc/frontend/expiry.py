"""Queue deadlines on the frontend side: a timer per streamed request that has one.

A request still queued when its deadline (``queue_timeout``, or the call's
gRPC deadline) passes is removed by the frontend streaming it, in one Lua call
(``RedisStore.expire``). A loop that holds it (claimed, preempted, swapped)
expires it itself at the end of its step, so until the request has started,
finished or expired the timer asks again. The stream that holds the request
stops its timer when it ends.
"""

from __future__ import annotations

import asyncio
import logging

from pagedserve.members import now_ms
from scheduler_svc.core.request import Request
from scheduler_svc.state.store import UNAVAILABLE, Expiry, RedisStore

log = logging.getLogger(__name__)
RETRY_S = 0.5  # a request past its deadline that a loop holds: ask again this often
MAX_SLEEP_S = 60.0  # wake up at least this often (clocks may jump)


class Expiries:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._tasks: set[asyncio.Task[None]] = set()  # referenced until done (asyncio keeps weak ones)

    def start(self, reqs: list[Request]) -> list[asyncio.Task[None]]:
        """A timer for each of ``reqs`` with a deadline."""
        return [self._start(r.request_id, r.deadline_ms) for r in reqs if r.deadline_ms]

    def _start(self, request_id: str, deadline: int) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._when_due(request_id, deadline))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    def stop(timers: list[asyncio.Task[None]]) -> None:
        for t in timers:
            t.cancel()

    async def _when_due(self, request_id: str, deadline: int) -> None:
        while True:
            await asyncio.sleep(max(0.0, min((deadline - now_ms()) / 1000, MAX_SLEEP_S)))
            if now_ms() < deadline:
                continue
            try:
                outcome = await self.store.expire(request_id)
            except UNAVAILABLE as exc:
                log.warning("could not expire %s: %s", request_id, exc, extra={"request_id": request_id})
                outcome = Expiry.LATER
            if outcome != Expiry.LATER:
                return
            await asyncio.sleep(RETRY_S)
