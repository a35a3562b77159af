"""Scheduler state in Redis: leases, loads, commits, submissions (the Lua lives in ``lua``).

The key scheme is ``pagedserve.keys``, rendered into the Lua with the rest of the
layout by ``schema``; what a step writes is built by the pure
``scheduler_svc.state.codec``. Loops write their executor's state once per step in
one Lua call that first checks the loop's fencing epoch for that executor, so
a loop killed at any point leaves the state of its last whole step and a
deposed loop can never write. Frontends write requests (submit) and
cancellations; claims and reaping move requests between the shared queue and
executors atomically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, cast

import redis.asyncio as aioredis
from redis import exceptions as redis_exceptions
from redis.client import NEVER_DECODE
from redis.commands.core import AsyncScript

from pagedserve.keys import Keys
from pagedserve.members import now_ms
from pagedserve.tiers import TIERS
from scheduler_svc.core import parallel
from scheduler_svc.core.logprob import Logprob
from scheduler_svc.core.placement import Candidate, PoolView
from scheduler_svc.core.request import Finish, Request
from scheduler_svc.core.snapshot import Snapshot
from scheduler_svc.state import codec, lua, schema

# Redis unreachable or slow: worth retrying (redis-py's errors do not derive from the builtins).
UNAVAILABLE = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError)
# A request nobody is attached to (its replica died, its client left) is cancelled after this long: the
# replicas' attachments and the loops' reaping of dead replicas both count it (--detach-timeout).
DETACH_TIMEOUT_S = 30.0


class Fenced(RuntimeError):
    """A newer leader holds this executor's lease, or it was reaped: stop writing."""


class Stale(RuntimeError):
    """Redis lost writes this loop made (it restarted from an older AOF): reload, and recompute."""


class DuplicateRequest(ValueError):
    """A live request already has this id."""


class Expiry(IntEnum):
    """What the expire script did with a request past its queue deadline."""

    NEVER = 0  # finished, started, or no deadline: it never expires now
    EXPIRED = 1  # it was queued: finished now, with reason ``deadline``
    LATER = 2  # not due yet, or a loop holds it (that loop expires it): ask again later


@dataclass(frozen=True, slots=True)
class Submitted:
    """What the submit script saw: the arrival number, the namespace's queue length (with
    this request, if queued) and its cumulative count of finished requests."""

    arrival: int
    queued: int
    finished: int


class Overloaded(RuntimeError):
    """The namespace's queue is at ``--max-pending-requests``: refused, nothing was stored."""

    def __init__(self, seen: Submitted) -> None:
        super().__init__(f"{seen.queued} requests are waiting in this namespace")
        self.seen = seen


@dataclass(slots=True)
class Op:
    """An entry of the incoming stream: a doorbell, and for ``cancel`` what to end. Moving KV: ``unlend``
    (request_id is a lend id), and ``offer`` and ``ask`` for the loop of executor ``to`` only, with ``data``
    (``codec.offer_from``, ``codec.ask_from``)."""

    stream_id: str
    op: str  # submit | cancel | requeue | unlend | offer | ask
    request_id: str
    reason: Finish | None = None
    to: str = ""
    data: str = ""


class RedisStore:
    def __init__(
        self, client: aioredis.Redis, namespace: str = "pagedserve", result_ttl: int = schema.RESULT_TTL_S
    ) -> None:
        self.r = client
        self.keys = Keys(namespace)
        self.result_ttl = result_ttl
        self._apply = self._script(lua.APPLY)
        self._submit = self._script(lua.SUBMIT)
        self._cancel = self._script(lua.CANCEL)
        self._expire = self._script(lua.EXPIRE)
        self._attach = self._script(lua.ATTACH)
        self._peek = self._script(lua.PEEK)
        self._claim = self._script(lua.CLAIM)
        self._reap = self._script(lua.REAP)
        self._acquire = self._script(lua.ACQUIRE)
        self._renew = self._script(lua.RENEW)
        self._release = self._script(lua.RELEASE)

    def _script(self, template: str) -> AsyncScript:
        """A script of ``lua``, with the schema rendered in."""
        return self.r.register_script(schema.render(template))

    # -- frontends ------------------------------------------------------------

    async def submit(
        self, req: Request, stop: list[str], policy: str, trace: str = "", hashes: list[str] | None = None
    ) -> int:
        """Persist a new request and queue it; returns its arrival number. ``trace``: the
        ``traceparent`` of its root span, for the loops' spans; ``hashes``: its prompt's block
        hashes (core/prefix.prompt_hashes), for prefix-aware placement."""
        return (await self.admit(req, stop, policy, trace, hashes=hashes)).arrival

    async def admit(
        self,
        req: Request,
        stop: list[str],
        policy: str,
        trace: str = "",
        max_pending: int = 0,
        hashes: list[str] | None = None,
    ) -> Submitted:
        """``submit``, under admission control: with ``max_pending`` > 0 the request is refused
        (``Overloaded``) while that many requests wait in the namespace's queue."""
        return await self.admit_group([req], stop, policy, trace, max_pending, hashes)

    async def admit_group(
        self,
        reqs: list[Request],
        stop: list[str],
        policy: str,
        trace: str = "",
        max_pending: int = 0,
        hashes: list[str] | None = None,
    ) -> Submitted:
        """``admit`` the completions of one parallel-sampling group (or one request alone) together:
        all are queued, or none. A group's own id must not be a live request's either."""
        k, head = self.keys, reqs[0]
        group = head.group
        # The other name of the request: a group's own id, or the completion 0 a group of this id would have.
        other = k.req(group) if group else k.req(parallel.completion_id(head.request_id, 0))
        keys = [k.arrival, k.queue, k.live, k.incoming, k.attached, k.counters, other]
        args: list[str | int | float] = [
            len(reqs),
            max_pending,
            len(head.prompt_ids),
            head.params.max_tokens,
            head.priority,
            repr(codec.queue_entry(0, "", head.priority, policy)[0]),
            now_ms(),
            trace,
            head.deadline_ms or "",
            group,
            head.params.n if group else "",
            codec.hashes_field(hashes or []),
            head.adapter_digest,  # placement prefers an executor holding it (core/lora.py)
        ]
        for req in reqs:
            rid = req.request_id
            keys += [k.req(rid), k.out(rid), k.logprobs(rid), k.prompt_logprobs(rid)]
            args += [rid, codec.spec_json(req, stop)]
        arrival, queued, finished = await self._submit(keys=keys, args=args)
        got = Submitted(int(arrival), int(queued), int(finished))
        if got.arrival == -1:
            raise DuplicateRequest(group or head.request_id)
        if got.arrival == -2:
            raise Overloaded(got)
        return got

    async def group_size(self, request_id: str) -> int:
        """How many completions the request ``request_id`` has if it asked for sampling.n > 1 (read
        from its completion 0); 0 if it is not such a request."""
        group, n = await self.r.hmget(self.keys.req(parallel.completion_id(request_id, 0)), "grp", "gn")
        return int(n) if group == request_id and n else 0

    async def cancel(self, request_id: str, reason: Finish) -> bool:
        """End a request (``abort`` or ``stop``) wherever it is; False if it is not live."""
        found = await self._cancel(
            keys=[self.keys.req(request_id)], args=[self.keys.prefix, request_id, reason.value, self.result_ttl]
        )
        return bool(found)

    async def expire(self, request_id: str) -> Expiry:
        """Expire a request whose queue deadline passed, if it is queued and has not started."""
        return Expiry(
            await self._expire(
                keys=[self.keys.req(request_id)], args=[self.keys.prefix, request_id, now_ms(), self.result_ttl]
            )
        )

    async def attach(self, request_ids: list[str]) -> list[str]:
        """Streams hold these requests: refresh them; returns those Redis lost (to submit again)."""
        if not request_ids:
            return []
        return list(await self._attach(keys=[self.keys.attached], args=[self.keys.prefix, now_ms(), *request_ids]))

    async def detached(self, idle_ms: int, limit: int = 256) -> list[str]:
        """Unfinished requests no stream has held for ``idle_ms``."""
        found = await self.r.zrangebyscore(self.keys.attached, "-inf", now_ms() - idle_ms, start=0, num=limit)
        return cast(list[str], found)

    async def request(self, request_id: str) -> tuple[dict[str, str], list[str]] | None:
        """A request's hash and generated tokens, read together; None if Redis does not know it."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self.keys.req(request_id))
        pipe.lrange(self.keys.out(request_id), 0, -1)
        fields, out = await pipe.execute()
        return (fields, out) if fields else None

    async def events_tail(self) -> str:
        last: Any = await self.r.xrevrange(self.keys.events, count=1)  # decoded: [(id, fields)]
        return str(last[0][0]) if last else "0-0"

    async def read_events(self, after: str, block_ms: int) -> list[tuple[str, schema.Event]]:
        got: Any = await self.r.xread({self.keys.events: after}, block=block_ms, count=256)  # [(stream, entries)]
        return [(eid, schema.Event.decode(fields["d"])) for _, entries in got for eid, fields in entries]

    async def output(self, request_id: str, start: int, end: int) -> list[int]:
        """Generated tokens ``[start, end)`` of a request (to fill a gap in its events)."""
        return [int(t) for t in await self.r.lrange(self.keys.out(request_id), start, end - 1)]

    async def logprobs(self, request_id: str, start: int, end: int | None = None) -> list[Logprob]:
        """Logprobs entries of generated tokens ``[start, end)`` (``end`` None: all from ``start``)."""
        raw = await self.r.lrange(self.keys.logprobs(request_id), start, -1 if end is None else end - 1)
        return [Logprob.of(json.loads(x)) for x in raw]

    async def prompt_logprobs(self, request_id: str) -> list[Logprob]:
        """Prompt logprobs entries by position, from the second prompt token on."""
        raw = await self.r.hgetall(self.keys.prompt_logprobs(request_id))
        return [Logprob.of(json.loads(v)) for _, v in sorted((int(k), v) for k, v in raw.items())]

    async def put_response(self, response_id: str, data: str) -> None:
        """Keep a ``/v1/responses`` answer (JSON) for ``--result-ttl``, as a finished request's output."""
        await self.r.set(self.keys.response(response_id), data, ex=self.result_ttl)

    async def get_response(self, response_id: str) -> str | None:
        """A kept ``/v1/responses`` answer; None once its TTL ran out (or never kept)."""
        return cast(str | None, await self.r.get(self.keys.response(response_id)))

    # -- leases ---------------------------------------------------------------

    async def acquire(self, executor: str, replica: str, ttl_ms: int) -> int | None:
        """Lead ``executor``'s loop: the new fencing epoch, or None if someone leads it or it was reaped."""
        x = self.keys.executor(executor)
        epoch = await self._acquire(keys=[x.leader, x.epoch, self.keys.evicted], args=[replica, ttl_ms, executor])
        return None if epoch is None else int(epoch)

    async def renew(self, executor: str, replica: str, ttl_ms: int) -> bool:
        return bool(await self._renew(keys=[self.keys.executor(executor).leader], args=[replica, ttl_ms]))

    async def release(self, executor: str, replica: str) -> None:
        await self._release(keys=[self.keys.executor(executor).leader], args=[replica])

    async def leader(self, executor: str) -> str | None:
        return cast(str | None, await self.r.get(self.keys.executor(executor).leader))

    async def lead_metrics(self, replica: str, ttl_ms: int) -> bool:
        """Take or keep the namespace's metrics lease (only its holder exports namespace gauges)."""
        if await self._renew(keys=[self.keys.metrics_leader], args=[replica, ttl_ms]):
            return True
        return bool(await self.r.set(self.keys.metrics_leader, replica, nx=True, px=ttl_ms))

    async def queued(self) -> int:
        return int(await self.r.zcard(self.keys.queue))

    # -- one executor's loop ----------------------------------------------------

    async def load(self, executor: str) -> Snapshot:
        x = self.keys.executor(executor)
        keys = [x.pool, x.live, x.computed, x.seq, x.cache, x.lru, *(x.free(t) for t in TIERS)]
        raw = await self.r.execute_command("EVAL", schema.render(lua.LOAD), len(keys), *keys, **{NEVER_DECODE: True})
        pool = _text_pairs(raw[0])
        live = [rid.decode() for rid in raw[1]]
        computed = _text_pairs(raw[2])
        totals = [int(n) for n in pool.get("blocks", "0,0,0").split(",")]
        free = tuple(codec.free_blocks(bitmap, total) for bitmap, total in zip(raw[6:], totals))
        ids = sorted(live)
        pipe = self.r.pipeline(transaction=True)
        for rid in ids:
            pipe.hgetall(self.keys.req(rid))
            pipe.lrange(self.keys.out(rid), 0, -1)
        rows = await pipe.execute()
        requests = []
        for i, rid in enumerate(ids):
            fields, out = rows[2 * i], rows[2 * i + 1]
            if fields.get("status", "finished") != "finished":
                requests.append(
                    (codec.request_from(rid, fields, out, int(computed.get(rid, 0))), codec.cancel_of(fields))
                )
        cache = {int(b): bytes.fromhex(h.decode()) for b, h in zip(raw[4][::2], raw[4][1::2])}
        ranks = {int(b): int(float(r)) for b, r in zip(raw[5][::2], raw[5][1::2])}
        # Lends change only in this executor's fenced commits, and this loop holds its lease: read apart.
        texts = cast(list[str], await self.r.hvals(x.lent))
        lent = [ref for text in texts for ref in codec.lent_blocks(text)]
        moving = int(cast(str | None, await self.r.get(x.moving)) or 0)
        return Snapshot(pool, free, requests, int(raw[3]), cache, ranks, lent, moving)

    async def views(self) -> dict[str, PoolView]:
        """Every pool's published view (placement's, and migration's choice of peers)."""
        usage = cast(dict[str, str], await self.r.hgetall(self.keys.usage))
        return {e: codec.view_from(e, v) for e, v in usage.items()}

    async def tail_incoming(self) -> str:
        last: Any = await self.r.xrevrange(self.keys.incoming, count=1)
        return str(last[0][0]) if last else "0-0"

    async def read_incoming(self, after: str, block_ms: int | None) -> tuple[list[Op], int]:
        """Doorbell entries after ``after`` (waiting up to ``block_ms`` for one), and the queue's length."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xread({self.keys.incoming: after}, block=block_ms, count=1024)
        pipe.zcard(self.keys.queue)
        got, queued = await pipe.execute()
        return [
            Op(eid, f["op"], f["id"], Finish(f["reason"]) if f.get("reason") else None, f.get("to", ""), f.get("d", ""))
            for _, entries in got or []
            for eid, f in entries
        ], int(queued)

    async def look(self, depth: int) -> tuple[list[Candidate], dict[str, PoolView]]:
        """The queue's head and every pool's published view, in one round trip."""
        rows, usage = await self._peek(keys=[self.keys.queue, self.keys.usage], args=[self.keys.prefix, depth])
        views = {e: codec.view_from(e, v) for e, v in zip(usage[::2], usage[1::2])}
        return [codec.candidate_from(r) for r in rows], views

    async def claim(self, executor: str, epoch: int, seq: int, queue_keys: list[str]) -> list[codec.Claimed]:
        """Take these queued requests for ``executor`` (a write: ``seq`` + 1); returns those it got."""
        try:
            rows = await self._claim(
                keys=self._fence(executor), args=[str(epoch), str(seq), self.keys.prefix, executor, *queue_keys]
            )
        except redis_exceptions.ResponseError as exc:
            raise _fenced(exc) from exc
        out = []
        for rid, flat, output in rows:
            fields = dict(zip(flat[::2], flat[1::2]))
            out.append(
                codec.Claimed(
                    codec.request_from(rid, fields, output),
                    codec.cancel_of(fields),
                    int(fields.get("ts", 0)),
                    fields.get("tp", ""),
                )
            )
        return out

    async def apply(self, executor: str, epoch: int, seq: int, ops: list[list[str]]) -> int:
        """Run one step's commands, fenced, in one call; returns the write sequence after it."""
        try:
            args = [str(epoch), str(seq), *schema.commit_args(ops)]
            return int(await self._apply(keys=self._fence(executor), args=args))
        except redis_exceptions.ResponseError as exc:
            raise _fenced(exc) from exc

    def _fence(self, executor: str) -> list[str]:
        """The keys the fence of a loop's write checks: the executor's epoch and write sequence."""
        x = self.keys.executor(executor)
        return [x.epoch, x.seq]

    async def reap(self, executor: str) -> int:
        """Forget a dead executor; returns how many of its requests went back to the queue."""
        return int(
            await self._reap(
                keys=self.keys.executor(executor).all(), args=[self.keys.prefix, executor, self.result_ttl, now_ms()]
            )
        )


def _text_pairs(flat: list[bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in zip(flat[::2], flat[1::2])}


def _fenced(exc: redis_exceptions.ResponseError) -> Exception:
    if "FENCED" in str(exc):
        return Fenced(str(exc))
    return Stale(str(exc)) if "STALE" in str(exc) else exc
