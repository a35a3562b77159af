"""Scheduler state in Redis: requests, block tables, free lists, queues, leases.

Every key shares one hash tag, ``{ns}``, so a Redis Cluster keeps them in one
slot. Keys (``ns`` is the namespace, ``pagedserve`` by default):

- ``{ns}:meta`` hash: the executor instance and pool sizes the state belongs to.
- ``{ns}:free:<tier>`` set: free block ids of tier 0 (device), 1 (CPU), 2 (disk).
- ``{ns}:live`` set: ids of requests waiting, running or swapped.
- ``{ns}:req:<id>`` hash: ``spec`` (JSON, immutable), ``status``,
  ``blocks`` (device block table), ``swap`` (tier:block list),
  ``preemptions``, ``finish_reason``.
- ``{ns}:computed`` hash: request id -> tokens whose KV is cached. It changes
  every step for every running request, so it is one command per step rather
  than one per request.
- ``{ns}:out:<id>`` list: generated token ids.
- ``{ns}:incoming`` stream: submit / abort / stop operations from frontends;
  ``{ns}:cursor`` is the id of the last one the loop has applied.
- ``{ns}:events`` stream: per step, the tokens produced and requests finished.
- ``{ns}:leader`` lease and ``{ns}:epoch`` fencing counter.
- ``{ns}:counters`` hash: preemptions, swapped blocks, steps, queue lengths,
  free and total blocks per pool.

Writes by the scheduling loop happen once per step in one Lua call (atomic, and
rejected when the loop's epoch is stale), so a loop killed at any point leaves
the state of the last whole step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis import exceptions as redis_exceptions

from scheduler_svc.core.blocks import TIERS, BlockManager
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.scheduler import Counters, Scheduler, SchedulerOutput, StepUpdate

FINISHED_TTL_S = 3600  # finished requests stay readable this long
_LUA_ARGS = 4000  # Lua's unpack() limit is ~8000; stay well below

_APPLY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED stale epoch ' .. ARGV[1])
end
local ops = cjson.decode(ARGV[2])
for i = 1, #ops do
  redis.call(unpack(ops[i]))
end
return #ops
"""

_SUBMIT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'finished' then
  return -1
end
local arrival = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('HSET', KEYS[1], 'spec', ARGV[2], 'arrival', arrival, 'status', 'submitted')
redis.call('XADD', KEYS[3], '*', 'op', 'submit', 'id', ARGV[1])
return arrival
"""

_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return nil
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# Redis unreachable or slow: worth retrying (redis-py's errors do not derive from the builtins).
UNAVAILABLE = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError)


class Fenced(RuntimeError):
    """A newer leader holds the lease: this loop must stop writing."""


class DuplicateRequest(ValueError):
    """A live request already has this id."""


def _spec_json(req: Request, stop: list[str]) -> str:
    p = req.params
    return json.dumps(
        {
            "prompt": req.prompt_ids,
            "priority": req.priority,
            "stop": stop,
            "params": {
                "max_tokens": p.max_tokens,
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k,
                "seed": p.seed,
                "stop_token_ids": list(p.stop_token_ids),
                "ignore_eos": p.ignore_eos,
            },
        }
    )


def _request_from(request_id: str, fields: dict[str, str], output: list[str], computed: int = 0) -> Request:
    spec = json.loads(fields["spec"])
    params = spec["params"]
    params["stop_token_ids"] = tuple(params["stop_token_ids"])
    status = fields.get("status", "submitted")
    return Request(
        request_id=request_id,
        prompt_ids=spec["prompt"],
        params=Params(**params),
        priority=spec["priority"],
        arrival=int(fields.get("arrival", 0)),
        output_ids=[int(t) for t in output],
        status=Status.WAITING if status == "submitted" else Status(status),
        num_computed=computed,
        blocks=[int(b) for b in fields.get("blocks", "").split(",") if b],
        swap_blocks=[(int(t), int(b)) for t, b in (x.split(":") for x in fields.get("swap", "").split(",") if x)],
        num_preemptions=int(fields.get("preemptions", 0)),
    )


def _signature(req: Request) -> tuple[object, ...]:
    """The part of a request's hash that changes only on transitions and new blocks."""
    return (req.status, len(req.blocks), tuple(req.swap_blocks), req.num_preemptions)


def _chunks(cmd: str, key: str, values: list[str]) -> list[list[str]]:
    return [[cmd, key, *values[i : i + _LUA_ARGS]] for i in range(0, len(values), _LUA_ARGS)]


@dataclass(slots=True)
class Incoming:
    stream_id: str
    op: str  # submit | abort | stop
    request_id: str


@dataclass(slots=True)
class Snapshot:
    meta: dict[str, str]
    free: tuple[list[int], list[int], list[int]]
    requests: list[Request]
    cursor: str
    counters: dict[str, int]


@dataclass(slots=True)
class Commit:
    """Everything one step changes, written in one atomic call."""

    blocks: BlockManager
    touched: dict[str, Request] = field(default_factory=dict)
    update: StepUpdate | None = None
    admitted: list[str] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    cursor: str | None = None
    counters: Counters | None = None
    usage: dict[str, int] | None = None  # queue lengths and free/total blocks per pool

    def record_step(self, sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Apply the executor's result to ``sched`` and take in everything the step changed."""
        self.touched.update(out.touched)
        self.update = sched.update(out, sampled)
        self.finished += self.update.finished

    def record_totals(self, sched: Scheduler) -> None:
        self.counters = sched.counters
        self.usage = sched.usage()


class RedisStore:
    def __init__(self, client: aioredis.Redis, namespace: str = "pagedserve") -> None:
        self.r = client
        self.ns = namespace
        p = "{" + namespace + "}:"
        self.k_meta, self.k_live, self.k_incoming = p + "meta", p + "live", p + "incoming"
        self.k_cursor, self.k_events, self.k_counters = p + "cursor", p + "events", p + "counters"
        self.k_leader, self.k_epoch, self.k_arrival = p + "leader", p + "epoch", p + "arrival"
        self.k_computed = p + "computed"
        # What the last commit wrote of each live request's hash, so that a step
        # rewrites only the requests whose status or block tables changed.
        self._saved: dict[str, tuple[object, ...]] = {}
        self._p = p
        self._apply = client.register_script(_APPLY)
        self._submit = client.register_script(_SUBMIT)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def k_req(self, request_id: str) -> str:
        return f"{self._p}req:{request_id}"

    def k_out(self, request_id: str) -> str:
        return f"{self._p}out:{request_id}"

    def k_free(self, tier: int) -> str:
        return f"{self._p}free:{tier}"

    # -- frontends ------------------------------------------------------------

    async def submit(self, req: Request, stop: list[str]) -> int:
        """Persist a new request and queue it for the loop; returns its arrival number."""
        rid = req.request_id
        arrival = await self._submit(
            keys=[self.k_req(rid), self.k_arrival, self.k_incoming, self.k_out(rid)], args=[rid, _spec_json(req, stop)]
        )
        if int(arrival) < 0:
            raise DuplicateRequest(rid)
        return int(arrival)

    async def send(self, op: str, request_id: str) -> None:
        """Queue an ``abort`` or ``stop`` for the loop."""
        await self.r.xadd(self.k_incoming, {"op": op, "id": request_id})

    async def is_live(self, request_id: str) -> bool:
        status = await self.r.hget(self.k_req(request_id), "status")
        return status is not None and status != Status.FINISHED.value

    async def events_tail(self) -> str:
        last = await self.r.xrevrange(self.k_events, count=1)
        return last[0][0] if last else "0-0"

    async def read_events(self, after: str, block_ms: int) -> list[tuple[str, dict]]:
        got = await self.r.xread({self.k_events: after}, block=block_ms, count=256)
        return [(eid, json.loads(fields["d"])) for _, entries in got for eid, fields in entries]

    # -- the loop -------------------------------------------------------------

    async def acquire(self, replica: str, ttl_ms: int) -> int | None:
        epoch = await self._acquire(keys=[self.k_leader, self.k_epoch], args=[replica, ttl_ms])
        return None if epoch is None else int(epoch)

    async def renew(self, replica: str, ttl_ms: int) -> bool:
        return bool(await self._renew(keys=[self.k_leader], args=[replica, ttl_ms]))

    async def release(self, replica: str) -> None:
        await self._release(keys=[self.k_leader], args=[replica])

    async def read_incoming(self, after: str, block_ms: int | None, count: int = 1024) -> list[Incoming]:
        got = await self.r.xread({self.k_incoming: after}, block=block_ms, count=count)
        return [Incoming(eid, f["op"], f["id"]) for _, entries in got for eid, f in entries]

    async def load_submitted(self, ids: list[str]) -> dict[str, Request]:
        pipe = self.r.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(self.k_req(rid))
        found = {}
        for rid, fields in zip(ids, await pipe.execute()):
            if fields.get("status") == "submitted":
                found[rid] = _request_from(rid, fields, [])
        return found

    async def load(self) -> Snapshot:
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self.k_meta)
        for tier in TIERS:
            pipe.smembers(self.k_free(tier))
        pipe.smembers(self.k_live)
        pipe.get(self.k_cursor)
        pipe.hgetall(self.k_counters)
        pipe.hgetall(self.k_computed)
        meta, f0, f1, f2, live, cursor, counters, computed = await pipe.execute()
        pipe = self.r.pipeline(transaction=True)
        ids = sorted(live)
        for rid in ids:
            pipe.hgetall(self.k_req(rid))
            pipe.lrange(self.k_out(rid), 0, -1)
        rows = await pipe.execute()
        requests = [_request_from(rid, rows[2 * i], rows[2 * i + 1], int(computed.get(rid, 0)))
                    for i, rid in enumerate(ids)]
        self._saved = {r.request_id: _signature(r) for r in requests}
        return Snapshot(
            meta=meta,
            free=tuple(sorted(int(b) for b in f) for f in (f0, f1, f2)),  # type: ignore[arg-type]
            requests=requests,
            cursor=cursor or "0-0",
            counters={k: int(v) for k, v in counters.items()},
        )

    async def apply(self, epoch: int, ops: list[list[str]]) -> None:
        try:
            await self._apply(keys=[self.k_epoch], args=[str(epoch), json.dumps(ops)])
        except redis_exceptions.ResponseError as exc:
            if "FENCED" in str(exc):
                raise Fenced(str(exc)) from exc
            raise

    def reset_ops(self, meta: dict[str, str], totals: tuple[int, int, int], requests: list[Request]) -> list[list[str]]:
        """Ops that bind the state to a new executor: every pool free, every live request recomputes."""
        ops: list[list[str]] = [["DEL", self.k_meta], ["HSET", self.k_meta, *[x for kv in meta.items() for x in kv]]]
        for tier, total in zip(TIERS, totals):
            ops.append(["DEL", self.k_free(tier)])
            ops += _chunks("SADD", self.k_free(tier), [str(b) for b in range(total)])
        ops.append(["DEL", self.k_computed])
        for req in requests:
            ops.append(["HSET", self.k_req(req.request_id), "status", Status.WAITING.value, "blocks", "", "swap", ""])
            self._saved.pop(req.request_id, None)
        return ops

    def commit_ops(self, c: Commit) -> list[list[str]]:
        ops: list[list[str]] = []
        for tier, changed in zip(TIERS, c.blocks.take_changes()):
            if not changed:
                continue
            freed = [str(b) for b in changed if c.blocks.is_free(tier, b)]
            owned = [str(b) for b in changed if not c.blocks.is_free(tier, b)]
            ops += _chunks("SADD", self.k_free(tier), freed) + _chunks("SREM", self.k_free(tier), owned)
        if c.admitted:
            ops += _chunks("SADD", self.k_live, c.admitted)
        computed: list[str] = []
        for rid, req in c.touched.items():
            if req.status == Status.FINISHED:
                continue
            computed += (rid, str(req.num_computed))
            sig = _signature(req)
            if self._saved.get(rid) == sig:
                continue
            self._saved[rid] = sig
            ops.append([
                "HSET", self.k_req(rid),
                "status", req.status.value,
                "blocks", ",".join(map(str, req.blocks)),
                "swap", ",".join(f"{t}:{b}" for t, b in req.swap_blocks),
                "preemptions", str(req.num_preemptions),
            ])  # fmt: skip
        if computed:
            ops += _chunks("HSET", self.k_computed, computed)
        events: dict[str, object] = {}
        if c.update is not None:
            for rid, tokens in c.update.new_tokens.items():
                ops.append(["RPUSH", self.k_out(rid), *map(str, tokens)])
            events["t"] = c.update.new_tokens
        if c.finished:
            for req in c.finished:
                rid = req.request_id
                reason = (req.finish_reason or Finish.ABORT).value
                ops.append(["HSET", self.k_req(rid), "status", Status.FINISHED.value, "finish_reason", reason,
                            "blocks", "", "swap", ""])
                ops.append(["HDEL", self.k_computed, rid])
                ops.append(["SREM", self.k_live, rid])
                self._saved.pop(rid, None)
                ops.append(["EXPIRE", self.k_req(rid), str(FINISHED_TTL_S)])
                ops.append(["EXPIRE", self.k_out(rid), str(FINISHED_TTL_S)])
            events["f"] = {r.request_id: [(r.finish_reason or Finish.ABORT).value, len(r.prompt_ids),
                                          len(r.output_ids)] for r in c.finished}
        if events.get("t") or events.get("f"):
            ops.append(["XADD", self.k_events, "MAXLEN", "~", "100000", "*", "d", json.dumps(events)])
        if c.cursor is not None:
            ops.append(["SET", self.k_cursor, c.cursor])
            ops.append(["XTRIM", self.k_incoming, "MINID", c.cursor])
        if c.counters is not None:
            values = {**c.counters.as_dict(), **(c.usage or {})}
            ops.append(["HSET", self.k_counters, *[x for k, v in values.items() for x in (k, str(v))]])
        return ops
