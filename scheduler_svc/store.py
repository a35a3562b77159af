"""Scheduler state in Redis: the scripts, leases, loads and commits.

The key scheme is ``pagedserve.keys``; what a step writes is built by the pure
``scheduler_svc.codec``. Loops write their executor's state once per step in
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

import redis.asyncio as aioredis
from redis import exceptions as redis_exceptions
from redis.client import NEVER_DECODE

from pagedserve.keys import Keys
from pagedserve.members import now_ms
from scheduler_svc import codec
from scheduler_svc.core.placement import Candidate, PoolView
from scheduler_svc.core.request import Finish, Request
from scheduler_svc.restore import Snapshot

# Redis unreachable or slow: worth retrying (redis-py's errors do not derive from the builtins).
UNAVAILABLE = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError)

# Every write of a loop: its epoch must lead, and the executor's state must be the
# one the loop last wrote (a restart that lost writes is refused as STALE). The
# write sequence goes up by one; ARGV[1] and ARGV[2] are the epoch and the sequence.
_FENCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED stale epoch ' .. ARGV[1])
end
local seq_key = string.sub(KEYS[1], 1, -6) .. 'seq'
if (redis.call('GET', seq_key) or '0') ~= ARGV[2] then
  return redis.error_reply('STALE state at write ' .. (redis.call('GET', seq_key) or '0') .. ', not ' .. ARGV[2])
end
local seq = redis.call('INCR', seq_key)
"""

# A step's commands (codec.CommitWriter), plus two bitmap operations of the codec's.
_APPLY = _FENCE + """
local ops = cjson.decode(ARGV[3])
for i = 1, #ops do
  local op = ops[i]
  if op[1] == 'FILL' then
    local n = tonumber(op[3])
    local tail = n % 8
    local bytes = string.rep(string.char(255), (n - tail) / 8)
    if tail > 0 then
      bytes = bytes .. string.char(256 - 2 ^ (8 - tail))
    end
    redis.call('SET', op[2], bytes)
  elseif op[1] == 'BITS' then
    for j = 4, #op do
      redis.call('SETBIT', op[2], op[j], op[3])
    end
  else
    redis.call(unpack(op))
  end
end
return redis.call('GET', seq_key)
"""

# One executor's pool as its last commit left it: pool hash, free bitmaps, live set,
# computed counts, write sequence, prefix cache (block -> hash, evictable block -> LRU
# rank). Bitmaps are binary: the caller reads the reply undecoded.
_LOAD = """
local x = ARGV[1]
return {redis.call('HGETALL', x .. 'pool'), redis.call('GET', x .. 'free:0') or '',
        redis.call('GET', x .. 'free:1') or '', redis.call('GET', x .. 'free:2') or '',
        redis.call('SMEMBERS', x .. 'live'), redis.call('HGETALL', x .. 'computed'),
        redis.call('GET', x .. 'seq') or '0', redis.call('HGETALL', x .. 'cache'),
        redis.call('ZRANGE', x .. 'lru', 0, -1, 'WITHSCORES')}
"""

# Requests enter the shared queue: one, or the completions of a parallel-sampling
# group (sampling.n), all or none. Queue members are "<arrival, 16 digits>:<id>"
# (codec.queue_entry); the score is the priority under the priority policy.
# Admission control lives here, not in a replica: with ARGV[2] > 0, requests are
# refused while that many wait in the namespace's queue, whichever replicas queued
# them. A group's id must not be a live request's, nor a request's id a live
# group's (KEYS[7]: the other one's 'req:' key), since Abort and Resume take either.
# Returns {arrival of the first (-1: duplicate id, -2: refused), queue length, the
# namespace's finished counter (for the retry hint)}.
# KEYS: arrival, queue, live, incoming, attached, counters, the other one's req key,
# then per request its req, out, lp and plp keys. ARGV: count, max pending, then
# the fields all share (plen, maxt, prio, qs, ts, tp, dl, group id, n, block
# hashes), then per request its id and spec.
_SUBMIT = """
local m = tonumber(ARGV[1])
local finished = tonumber(redis.call('HGET', KEYS[6], 'finished') or '0')
local function live(key)
  local status = key ~= '' and redis.call('HGET', key, 'status')
  return status and status ~= 'finished'
end
if live(KEYS[7]) and (ARGV[10] ~= '' or redis.call('HGET', KEYS[7], 'grp') == ARGV[13]) then
  return {-1, 0, finished}
end
for i = 0, m - 1 do
  if live(KEYS[8 + 4 * i]) then
    return {-1, 0, finished}
  end
end
local queued = redis.call('ZCARD', KEYS[2])
local limit = tonumber(ARGV[2])
if limit > 0 and queued >= limit then
  return {-2, queued, finished}
end
local first = nil
for i = 0, m - 1 do
  local rk, rid = KEYS[8 + 4 * i], ARGV[13 + 2 * i]
  local arrival = redis.call('INCR', KEYS[1])
  first = first or arrival
  local qk = string.format('%016d:', arrival) .. rid
  redis.call('DEL', rk, KEYS[9 + 4 * i], KEYS[10 + 4 * i], KEYS[11 + 4 * i])
  redis.call('HSET', rk, 'spec', ARGV[14 + 2 * i], 'arrival', arrival, 'status', 'waiting', 'executor', '',
             'plen', ARGV[3], 'maxt', ARGV[4], 'prio', ARGV[5], 'qk', qk, 'qs', ARGV[6], 'ts', ARGV[7], 'tp', ARGV[8],
             'dl', ARGV[9], 'bh', ARGV[12])
  if ARGV[10] ~= '' then
    redis.call('HSET', rk, 'grp', ARGV[10], 'gn', ARGV[11])
  end
  redis.call('ZADD', KEYS[2], ARGV[6], qk)
  redis.call('SADD', KEYS[3], rid)
  redis.call('ZADD', KEYS[5], ARGV[7], rid)
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', '10000', '*', 'op', 'submit', 'id', ARGV[13])
return {first, queued + m, finished}
"""

# Finishing a request that holds nothing (queued): the same fields and event
# shape as codec.CommitWriter and codec.Event. Used by _CANCEL and _REAP.
_FINISH_QUEUED = """
local function finish_queued(p, rid, reason, ttl)
  local rk, ok = p .. 'req:' .. rid, p .. 'out:' .. rid
  redis.call('HSET', rk, 'status', 'finished', 'finish_reason', reason, 'executor', '', 'blocks', '', 'swap', '')
  redis.call('SREM', p .. 'live', rid)
  redis.call('ZREM', p .. 'attached', rid)
  redis.call('EXPIRE', rk, ttl)
  redis.call('EXPIRE', ok, ttl)
  redis.call('EXPIRE', p .. 'lp:' .. rid, ttl)
  redis.call('EXPIRE', p .. 'plp:' .. rid, ttl)
  local ev = {f = {}}
  ev.f[rid] = {reason, redis.call('LLEN', ok)}
  redis.call('XADD', p .. 'events', 'MAXLEN', '~', '100000', '*', 'd', cjson.encode(ev))
end
"""

# A frontend ends a request (abort, or a stop string it saw). Queued: finished
# here. Placed: the flag stays on the request and its loop is rung.
_CANCEL = _FINISH_QUEUED + """
local p, rid, reason = ARGV[1], ARGV[2], ARGV[3]
local rk = p .. 'req:' .. rid
local f = redis.call('HMGET', rk, 'status', 'qk')
if not f[1] or f[1] == 'finished' then
  return 0
end
redis.call('HSET', rk, 'cancel', reason)
redis.call('ZREM', p .. 'attached', rid)
if redis.call('ZREM', p .. 'queue', f[2]) == 1 then
  finish_queued(p, rid, reason, ARGV[4])
else
  redis.call('XADD', p .. 'incoming', 'MAXLEN', '~', '10000', '*', 'op', 'cancel', 'id', rid, 'reason', reason)
end
return 1
"""

# A request's queue deadline (field 'dl', ms) may have passed: if it is in the shared
# queue and has not started (core/deadline.py), it finishes here with 'deadline'.
# Returns 1 if it expired now, 0 if it never will (finished, started, no deadline),
# 2 if not yet, or if a loop holds it (claimed, running, swapped): that loop expires
# what it holds, and the caller asks again a little later.
_EXPIRE = _FINISH_QUEUED + """
local p, rid, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local rk = p .. 'req:' .. rid
local f = redis.call('HMGET', rk, 'status', 'qk', 'dl', 'executor')
local dl = tonumber(f[3] or '0') or 0
if not f[1] or f[1] == 'finished' or dl <= 0 or redis.call('LLEN', p .. 'out:' .. rid) > 0 then
  return 0
end
if now < dl then
  return 2
end
if f[1] == 'waiting' and (f[4] or '') == '' and redis.call('ZREM', p .. 'queue', f[2]) == 1 then
  redis.call('HINCRBY', p .. 'counters', 'finished', 1)
  finish_queued(p, rid, 'deadline', ARGV[4])
  return 1
end
return 2
"""

# Streams hold these requests now: refresh their attachment. Returns the ids
# Redis does not know (lost in a rollback after a crash): their frontend submits
# them again.
_ATTACH = """
local p, now = ARGV[1], ARGV[2]
local missing = {}
for i = 3, #ARGV do
  local status = redis.call('HGET', p .. 'req:' .. ARGV[i], 'status')
  if not status then
    table.insert(missing, ARGV[i])
  elseif status ~= 'finished' then
    redis.call('ZADD', p .. 'attached', now, ARGV[i])
  end
end
return missing
"""

# The head of the queue with what placement needs of each request, and how many of each
# request's leading prompt blocks (field 'bh', its block hashes) each executor caches:
# "executor=blocks,..." (nonzero ones; codec.hits_from). The walk stops at an executor's
# first miss, so it costs about the hits it finds.
_PEEK = """
local p = ARGV[1]
local execs = redis.call('HKEYS', p .. 'usage')
local out = {}
for i, qk in ipairs(redis.call('ZRANGE', p .. 'queue', 0, tonumber(ARGV[2]) - 1)) do
  local rid = string.sub(qk, 18)
  local f = redis.call('HMGET', p .. 'req:' .. rid, 'plen', 'maxt', 'prio', 'bh')
  local hits = {}
  if f[4] and f[4] ~= '' then
    for _, e in ipairs(execs) do
      local set, n = p .. 'x:' .. e .. ':hashes', 0
      for h in string.gmatch(f[4], '[^,]+') do
        if redis.call('SISMEMBER', set, h) == 0 then
          break
        end
        n = n + 1
      end
      if n > 0 then
        table.insert(hits, e .. '=' .. n)
      end
    end
  end
  out[i] = {qk, f[1] or '0', f[2] or '0', f[3] or '0', redis.call('LLEN', p .. 'out:' .. rid),
            table.concat(hits, ',')}
end
return out
"""

# A loop takes queued requests for its executor: each lands on exactly one
# executor, and the queued completions of a parallel-sampling group ('grp', 'gn':
# ids "<group>#<index>") land together. Nothing is taken for a draining executor.
_CLAIM = _FENCE + """
local p, eid = ARGV[3], ARGV[4]
local out = {}
if redis.call('HGET', p .. 'exec:' .. eid, 'state') == 'draining' then
  return out
end
local live = p .. 'x:' .. eid .. ':live'
local function take(rid)
  local rk = p .. 'req:' .. rid
  redis.call('HSET', rk, 'executor', eid)
  redis.call('SADD', live, rid)
  table.insert(out, {rid, redis.call('HGETALL', rk), redis.call('LRANGE', p .. 'out:' .. rid, 0, -1)})
  return redis.call('HMGET', rk, 'grp', 'gn')
end
for i = 5, #ARGV do
  if redis.call('ZREM', p .. 'queue', ARGV[i]) == 1 then
    local rid = string.sub(ARGV[i], 18)
    local g = take(rid)
    if g[1] and g[1] ~= '' then
      for j = 0, tonumber(g[2]) - 1 do
        local mate = g[1] .. '#' .. j
        local qk = redis.call('HGET', p .. 'req:' .. mate, 'qk')
        if mate ~= rid and qk and redis.call('ZREM', p .. 'queue', qk) == 1 then
          take(mate)
        end
      end
    end
  end
end
return out
"""

# An executor is gone: fence its loop, send its requests back to the queue (or
# finish the cancelled ones), forget its pool, and never lead it again.
_REAP = _FINISH_QUEUED + """
local p, eid, now = ARGV[1], ARGV[2], tonumber(ARGV[4])
local x = p .. 'x:' .. eid .. ':'
local requeued = 0
for _, rid in ipairs(redis.call('SMEMBERS', x .. 'live')) do
  local rk = p .. 'req:' .. rid
  local f = redis.call('HMGET', rk, 'status', 'cancel', 'qk', 'qs')
  if f[1] and f[1] ~= 'finished' then
    if f[2] then
      finish_queued(p, rid, f[2], ARGV[3])
    else
      redis.call('HSET', rk, 'status', 'waiting', 'executor', '', 'blocks', '', 'swap', '')
      redis.call('ZADD', p .. 'queue', f[4], f[3])
      requeued = requeued + 1
    end
  end
end
redis.call('DEL', x .. 'live', x .. 'computed', x .. 'pool', x .. 'counters', x .. 'leader', x .. 'epoch',
           x .. 'seq', x .. 'free:0', x .. 'free:1', x .. 'free:2', x .. 'cache', x .. 'lru', x .. 'hashes')
redis.call('HDEL', p .. 'usage', eid)
redis.call('ZADD', p .. 'evicted', now, eid)
redis.call('ZREMRANGEBYSCORE', p .. 'evicted', '-inf', now - 86400000)
redis.call('ZREM', p .. 'executors', eid)
if requeued > 0 then
  redis.call('XADD', p .. 'incoming', 'MAXLEN', '~', '10000', '*', 'op', 'requeue', 'id', eid)
end
return requeued
"""

# The epoch is the server's clock in microseconds (and above the last one): unlike a
# counter, it never repeats after a restart that lost the last increments.
_ACQUIRE = """
if redis.replicate_commands then redis.replicate_commands() end
if redis.call('ZSCORE', KEYS[3], ARGV[3]) then
  return nil
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  local epoch = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('GET', KEYS[2]) or '0')
  if epoch <= last then
    epoch = last + 1
  end
  local text = string.format('%.0f', epoch)
  redis.call('SET', KEYS[2], text)
  return text
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
    """An entry of the incoming stream: a doorbell, and for ``cancel`` what to end."""

    stream_id: str
    op: str  # submit | cancel | requeue
    request_id: str
    reason: Finish | None = None


class RedisStore:
    def __init__(self, client: aioredis.Redis, namespace: str = "pagedserve",
                 result_ttl: int = codec.RESULT_TTL_S) -> None:
        self.r = client
        self.keys = Keys(namespace)
        self.result_ttl = result_ttl
        self._apply = client.register_script(_APPLY)
        self._submit = client.register_script(_SUBMIT)
        self._cancel = client.register_script(_CANCEL)
        self._expire = client.register_script(_EXPIRE)
        self._attach = client.register_script(_ATTACH)
        self._peek = client.register_script(_PEEK)
        self._claim = client.register_script(_CLAIM)
        self._reap = client.register_script(_REAP)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    # -- frontends ------------------------------------------------------------

    async def submit(self, req: Request, stop: list[str], policy: str, trace: str = "",
                     hashes: list[str] | None = None) -> int:
        """Persist a new request and queue it; returns its arrival number. ``trace``: the
        ``traceparent`` of its root span, for the loops' spans; ``hashes``: its prompt's block
        hashes (core/prefix.prompt_hashes), for prefix-aware placement."""
        return (await self.admit(req, stop, policy, trace, hashes=hashes)).arrival

    async def admit(self, req: Request, stop: list[str], policy: str, trace: str = "",
                    max_pending: int = 0, hashes: list[str] | None = None) -> Submitted:
        """``submit``, under admission control: with ``max_pending`` > 0 the request is refused
        (``Overloaded``) while that many requests wait in the namespace's queue."""
        return await self.admit_group([req], stop, policy, trace, max_pending, hashes)

    async def admit_group(self, reqs: list[Request], stop: list[str], policy: str, trace: str = "",
                          max_pending: int = 0, hashes: list[str] | None = None) -> Submitted:
        """``admit`` the completions of one parallel-sampling group (or one request alone) together:
        all are queued, or none. A group's own id must not be a live request's either."""
        k, head = self.keys, reqs[0]
        group = head.group
        # The other name of the request: a group's own id, or the completion 0 a group of this id would have.
        other = k.req(group) if group else k.req(f"{head.request_id}#0")
        keys = [k.arrival, k.queue, k.live, k.incoming, k.attached, k.counters, other]
        args: list[object] = [len(reqs), max_pending, len(head.prompt_ids), head.params.max_tokens, head.priority,
                              repr(codec.queue_entry(0, "", head.priority, policy)[0]), now_ms(), trace,
                              head.deadline_ms or "", group, head.params.n if group else "",
                              codec.hashes_field(hashes or [])]
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
        group, n = await self.r.hmget(self.keys.req(f"{request_id}#0"), "grp", "gn")
        return int(n) if group == request_id and n else 0

    async def cancel(self, request_id: str, reason: Finish) -> bool:
        """End a request (``abort`` or ``stop``) wherever it is; False if it is not live."""
        found = await self._cancel(keys=[self.keys.req(request_id)],
                                   args=[self.keys.prefix, request_id, reason.value, self.result_ttl])
        return bool(found)

    async def expire(self, request_id: str) -> Expiry:
        """Expire a request whose queue deadline passed, if it is queued and has not started."""
        return Expiry(await self._expire(keys=[self.keys.req(request_id)],
                                        args=[self.keys.prefix, request_id, now_ms(), self.result_ttl]))

    async def attach(self, request_ids: list[str]) -> list[str]:
        """Streams hold these requests: refresh them; returns those Redis lost (to submit again)."""
        if not request_ids:
            return []
        return list(await self._attach(keys=[self.keys.attached], args=[self.keys.prefix, now_ms(), *request_ids]))

    async def detached(self, idle_ms: int, limit: int = 256) -> list[str]:
        """Unfinished requests no stream has held for ``idle_ms``."""
        return list(await self.r.zrangebyscore(self.keys.attached, "-inf", now_ms() - idle_ms, start=0, num=limit))

    async def request(self, request_id: str) -> tuple[dict[str, str], list[str]] | None:
        """A request's hash and generated tokens, read together; None if Redis does not know it."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self.keys.req(request_id))
        pipe.lrange(self.keys.out(request_id), 0, -1)
        fields, out = await pipe.execute()
        return (fields, out) if fields else None

    async def events_tail(self) -> str:
        last = await self.r.xrevrange(self.keys.events, count=1)
        return last[0][0] if last else "0-0"

    async def read_events(self, after: str, block_ms: int) -> list[tuple[str, codec.Event]]:
        got = await self.r.xread({self.keys.events: after}, block=block_ms, count=256)
        return [(eid, codec.Event.decode(fields["d"])) for _, entries in got for eid, fields in entries]

    async def output(self, request_id: str, start: int, end: int) -> list[int]:
        """Generated tokens ``[start, end)`` of a request (to fill a gap in its events)."""
        return [int(t) for t in await self.r.lrange(self.keys.out(request_id), start, end - 1)]

    async def logprobs(self, request_id: str, start: int, end: int | None = None) -> list[object]:
        """Logprobs entries of generated tokens ``[start, end)`` (``end`` None: all from ``start``)."""
        raw = await self.r.lrange(self.keys.logprobs(request_id), start, -1 if end is None else end - 1)
        return [json.loads(x) for x in raw]

    async def prompt_logprobs(self, request_id: str) -> list[object]:
        """Prompt logprobs entries by position, from the second prompt token on."""
        raw = await self.r.hgetall(self.keys.prompt_logprobs(request_id))
        return [json.loads(v) for _, v in sorted((int(k), v) for k, v in raw.items())]

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
        return await self.r.get(self.keys.executor(executor).leader)

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
        raw = await self.r.execute_command("EVAL", _LOAD, 0, x.prefix, **{NEVER_DECODE: True})
        pool = _text_pairs(raw[0])
        live = [rid.decode() for rid in raw[4]]
        computed = _text_pairs(raw[5])
        totals = [int(n) for n in pool.get("blocks", "0,0,0").split(",")]
        free = tuple(codec.free_blocks(bitmap, total) for bitmap, total in zip(raw[1:4], totals))
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
                requests.append((codec.request_from(rid, fields, out, int(computed.get(rid, 0))),
                                 codec.cancel_of(fields)))
        cache = {int(b): bytes.fromhex(h.decode()) for b, h in zip(raw[7][::2], raw[7][1::2])}
        ranks = {int(b): int(float(r)) for b, r in zip(raw[8][::2], raw[8][1::2])}
        return Snapshot(pool, free, requests, int(raw[6]), cache, ranks)

    async def tail_incoming(self) -> str:
        last = await self.r.xrevrange(self.keys.incoming, count=1)
        return last[0][0] if last else "0-0"

    async def read_incoming(self, after: str, block_ms: int | None) -> tuple[list[Op], int]:
        """Doorbell entries after ``after`` (waiting up to ``block_ms`` for one), and the queue's length."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xread({self.keys.incoming: after}, block=block_ms, count=1024)
        pipe.zcard(self.keys.queue)
        got, queued = await pipe.execute()
        return [Op(eid, f["op"], f["id"], Finish(f["reason"]) if f.get("reason") else None)
                for _, entries in got or [] for eid, f in entries], int(queued)

    async def look(self, depth: int) -> tuple[list[Candidate], dict[str, PoolView]]:
        """The queue's head and every pool's published view, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        await self._peek(keys=[self.keys.queue], args=[self.keys.prefix, depth], client=pipe)  # queues it
        pipe.hgetall(self.keys.usage)
        rows, usage = await pipe.execute()
        return [codec.candidate_from(r) for r in rows], {e: codec.view_from(e, v) for e, v in usage.items()}

    async def claim(self, executor: str, epoch: int, seq: int, queue_keys: list[str]) -> list[codec.Claimed]:
        """Take these queued requests for ``executor`` (a write: ``seq`` + 1); returns those it got."""
        try:
            rows = await self._claim(keys=[self.keys.executor(executor).epoch],
                                     args=[str(epoch), str(seq), self.keys.prefix, executor, *queue_keys])
        except redis_exceptions.ResponseError as exc:
            raise _fenced(exc) from exc
        out = []
        for rid, flat, output in rows:
            fields = dict(zip(flat[::2], flat[1::2]))
            out.append(codec.Claimed(codec.request_from(rid, fields, output), codec.cancel_of(fields),
                                     int(fields.get("ts", 0)), fields.get("tp", "")))
        return out

    async def apply(self, executor: str, epoch: int, seq: int, ops: list[list[str]]) -> int:
        """Run one step's commands, fenced; returns the write sequence after it."""
        try:
            return int(await self._apply(keys=[self.keys.executor(executor).epoch],
                                         args=[str(epoch), str(seq), json.dumps(ops)]))
        except redis_exceptions.ResponseError as exc:
            raise _fenced(exc) from exc

    async def reap(self, executor: str) -> int:
        """Forget a dead executor; returns how many of its requests went back to the queue."""
        return int(await self._reap(keys=[self.keys.evicted],
                                    args=[self.keys.prefix, executor, self.result_ttl, now_ms()]))


def _text_pairs(flat: list[bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in zip(flat[::2], flat[1::2])}


def _fenced(exc: redis_exceptions.ResponseError) -> Exception:
    if "FENCED" in str(exc):
        return Fenced(str(exc))
    return Stale(str(exc)) if "STALE" in str(exc) else exc
