"""An executor's life as schedulers see it: serving, draining, failed; and its
membership record in Redis, renewed by a heartbeat.

With ``--redis-url`` the executor registers itself (``pagedserve.members``):
its record says where it is (``--advertise-address``), what it serves and how
large its pools are, and carries a TTL that the heartbeat renews every third
of ``--lease-ms``. It writes nothing else. If schedulers evicted it (a step
failed while it was unreachable), it comes back as a new instance with empty
block tables. On SIGTERM it drains: state ``draining`` (no new requests),
its loop moves what a peer can hold there at once, KV included (migration,
``scheduler_svc/core/migration.py``), and from ``evacuate_at_ms`` what still
runs by recompute; it exits once nothing is placed on it and no peer still
reads its lent blocks, or at ``--drain-timeout``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.members import (
    DRAINING,
    SERVING,
    Member,
    Registry,
    describe_mismatch,
    now_ms,
)

log = logging.getLogger(__name__)
FAILED = "failed"
POLL_S = 0.2


@dataclass(slots=True)
class Lifecycle:
    state: str = SERVING
    evacuate_at_ms: int = 0
    drain_deadline_ms: int = 0

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    def drain(self, timeout_s: float) -> None:
        """Stop taking requests; schedulers move what is left a little before ``timeout_s``."""
        now = now_ms()
        margin = min(5.0, timeout_s / 5)
        self.state = DRAINING
        self.evacuate_at_ms = now + int((timeout_s - margin) * 1000)
        self.drain_deadline_ms = now + int(timeout_s * 1000)

    def fail(self) -> None:
        self.state = FAILED


class Registration:
    """Keeps this executor's membership record alive while it serves or drains."""

    def __init__(
        self,
        registry: Registry,
        lifecycle: Lifecycle,
        member: Callable[[], Member],
        renew_instance: Callable[[], str],
        lease_ms: int,
    ) -> None:
        self.registry = registry
        self.lifecycle = lifecycle
        self.member = member  # the record as of now (state and instance id change)
        self.renew_instance = renew_instance
        self.lease_ms = lease_ms
        self._refused = False

    async def beat(self) -> None:
        if self.lifecycle.state == FAILED:
            await self.registry.deregister(self.member().instance_id)
            return
        m = self.member()
        identity = await self.registry.register(m, self.lease_ms)
        if identity is None:
            new = self.renew_instance()
            log.warning(
                "schedulers evicted instance %s (a step failed while unreachable); rejoining as %s", m.instance_id, new
            )
            identity = await self.registry.register(self.member(), self.lease_ms)
        refused = bool(identity) and not m.matches(identity or {})
        if refused and not self._refused:
            log.error("%s; this executor gets no work in this namespace", describe_mismatch(m, identity or {}))
        self._refused = refused

    async def announce_drain(self) -> None:
        """Ring the loops' doorbell: this executor's loop starts moving its requests at its next turn rather
        than at its manager's next membership read (up to a second later)."""
        try:
            await self.registry.ring_drain(self.member().instance_id)
        except Exception as exc:
            log.warning("could not ring the drain doorbell (%s); the loops see the record", exc)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.beat()
            except Exception as exc:  # redis down: the record expires and schedulers reap us
                log.warning("heartbeat failed: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.lease_ms / 3000)
            except TimeoutError:
                pass

    async def drained(self, lending: Callable[[], bool] = lambda: False) -> None:
        """Return once nothing is placed on this executor any more and nothing is ``lending`` (lent
        to peers still to read it), or at the drain deadline."""
        while now_ms() < self.lifecycle.drain_deadline_ms:
            try:
                if not lending() and await self.registry.placed(self.member().instance_id) == 0:
                    return
            except Exception as exc:
                log.warning("cannot read placements (%s); waiting for the deadline", exc)
            await asyncio.sleep(POLL_S)
        log.warning("drain deadline reached with requests still placed here; their schedulers recompute them")

    async def leave(self) -> None:
        """Delete the record: schedulers reap what is left at once."""
        try:
            await self.registry.deregister(self.member().instance_id)
        except Exception as exc:
            log.warning("could not delete the membership record (%s); it expires on its own", exc)


async def quiet(lifecycle: Lifecycle, last_step: Callable[[], float], idle_s: float = 2.0) -> None:
    """Without Redis (a statically configured executor): return once no step has come
    for ``idle_s`` seconds (its schedulers finished or moved its requests), or at
    the drain deadline."""
    loop = asyncio.get_running_loop()
    while now_ms() < lifecycle.drain_deadline_ms:
        if loop.time() - last_step() >= idle_s:
            return
        await asyncio.sleep(POLL_S)
