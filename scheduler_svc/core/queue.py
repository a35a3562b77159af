"""Waiting and swapped queues behind one interface, one class per policy.

FCFS keeps arrival order (a preempted request goes back to the front, as in
vLLM); priority orders by ``(priority, arrival, request_id)``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from scheduler_svc.core.request import Request

POLICIES = ("fcfs", "priority")


class RequestQueue(Protocol):
    def add(self, req: Request) -> None: ...
    def prepend(self, req: Request) -> None:
        """Put back a request that was preempted, ahead of newer arrivals."""

    def peek(self) -> Request | None: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request | None:
        return self._q[0] if self._q else None

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """A heap with lazy deletion: ``remove`` is O(1), stale entries are skipped.

    Entries carry a push counter: a request removed and added again (requeued,
    then claimed back) leaves a stale entry with the same key, and the heap
    must never fall through to comparing requests."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, str], int, Request]] = []
        self._live: dict[str, Request] = {}
        self._pushes = 0

    def add(self, req: Request) -> None:
        self._live[req.request_id] = req
        self._pushes += 1
        heapq.heappush(self._heap, (req.order_key, self._pushes, req))

    prepend = add  # order comes from the key alone

    def _settle(self) -> None:
        while self._heap and self._live.get(self._heap[0][2].request_id) is not self._heap[0][2]:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._settle()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._settle()
        _, _, req = heapq.heappop(self._heap)
        del self._live[req.request_id]
        return req

    def remove(self, req: Request) -> None:
        del self._live[req.request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._live.values(), key=lambda r: r.order_key))


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
