"""The Lua scripts of the scheduler state in Redis (``store.RedisStore`` runs them).

Each runs atomically on the server: fenced writes of a loop's step, claims,
submissions, cancellations, reaping, leases. The fields they write follow the
shapes of the pure ``scheduler_svc.state.codec`` (tests check the two against each
other on a real server).

These are templates: every key, the queue members' layout, the streams' lengths and
the events' JSON are ``${...}`` items of ``scheduler_svc.state.schema``, rendered in
when a store loads the scripts (``schema.render``). Keys are Lua expressions of the
script's ``p``, the namespace's prefix.
"""

from __future__ import annotations

# Every write of a loop: its epoch must lead, and the executor's state must be the
# one the loop last wrote (a restart that lost writes is refused as STALE). The
# write sequence goes up by one. KEYS[1], KEYS[2]: the executor's epoch and seq;
# ARGV[1] and ARGV[2]: the loop's epoch and the sequence it last wrote.
FENCE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED stale epoch ' .. ARGV[1])
end
local seq_key = KEYS[2]
if (redis.call('GET', seq_key) or '0') ~= ARGV[2] then
  return redis.error_reply('STALE state at write ' .. (redis.call('GET', seq_key) or '0') .. ', not ' .. ARGV[2])
end
local seq = redis.call('INCR', seq_key)
"""

# A step's commands (commit.CommitWriter), plus the schema's two bitmap operations. From
# ARGV[3] on (schema.commit_args), each command is its length n, then its n words: the
# command name at ARGV[i + 1], its key at ARGV[i + 2], its last word at ARGV[i + n].
APPLY = (
    FENCE
    + """
local i = 3
while i <= #ARGV do
  local n, cmd = tonumber(ARGV[i]), ARGV[i + 1]
  if cmd == ${FILL} then
    local bits = tonumber(ARGV[i + 3])
    local tail = bits % 8
    local bytes = string.rep(string.char(255), (bits - tail) / 8)
    if tail > 0 then
      bytes = bytes .. string.char(256 - 2 ^ (8 - tail))
    end
    redis.call('SET', ARGV[i + 2], bytes)
  elseif cmd == ${BITS} then
    for b in string.gmatch(ARGV[i + 4], '%d+') do
      redis.call('SETBIT', ARGV[i + 2], b, ARGV[i + 3])
    end
  else
    redis.call(unpack(ARGV, i + 1, i + n))
  end
  i = i + n + 1
end
return redis.call('GET', seq_key)
"""
)

# One executor's pool as its last commit left it: pool hash, live set, computed counts,
# write sequence, prefix cache (block -> hash, evictable block -> LRU rank), then each
# tier's free bitmap; KEYS name them in that order. Bitmaps are binary: the caller reads
# the reply undecoded.
LOAD = """
local out = {redis.call('HGETALL', KEYS[1]), redis.call('SMEMBERS', KEYS[2]), redis.call('HGETALL', KEYS[3]),
             redis.call('GET', KEYS[4]) or '0', redis.call('HGETALL', KEYS[5]),
             redis.call('ZRANGE', KEYS[6], 0, -1, 'WITHSCORES')}
for i = 7, #KEYS do
  table.insert(out, redis.call('GET', KEYS[i]) or '')
end
return out
"""

# Requests enter the shared queue: one, or the completions of a parallel-sampling
# group (sampling.n), all or none. Queue members are schema.queue_member's
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
# hashes, LoRA adapter digest or ''), then per request its id and spec.
SUBMIT = """
local m = tonumber(ARGV[1])
local finished = tonumber(redis.call('HGET', KEYS[6], 'finished') or '0')
local function live(key)
  local status = key ~= '' and redis.call('HGET', key, 'status')
  return status and status ~= 'finished'
end
if live(KEYS[7]) and (ARGV[10] ~= '' or redis.call('HGET', KEYS[7], 'grp') == ARGV[14]) then
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
  local rk, rid = KEYS[8 + 4 * i], ARGV[14 + 2 * i]
  local arrival = redis.call('INCR', KEYS[1])
  first = first or arrival
  local qk = ${queue_member(arrival, rid)}
  redis.call('DEL', rk, KEYS[9 + 4 * i], KEYS[10 + 4 * i], KEYS[11 + 4 * i])
  redis.call('HSET', rk, 'spec', ARGV[15 + 2 * i], 'arrival', arrival, 'status', 'waiting', 'executor', '',
             'plen', ARGV[3], 'maxt', ARGV[4], 'prio', ARGV[5], 'qk', qk, 'qs', ARGV[6], 'ts', ARGV[7], 'tp', ARGV[8],
             'dl', ARGV[9], 'bh', ARGV[12])
  if ARGV[10] ~= '' then
    redis.call('HSET', rk, 'grp', ARGV[10], 'gn', ARGV[11])
  end
  if ARGV[13] ~= '' then
    redis.call('HSET', rk, 'lora', ARGV[13])
  end
  redis.call('ZADD', KEYS[2], ARGV[6], qk)
  redis.call('SADD', KEYS[3], rid)
  redis.call('ZADD', KEYS[5], ARGV[7], rid)
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ${INCOMING_MAXLEN}, '*', 'op', 'submit', 'id', ARGV[14])
return {first, queued + m, finished}
"""

# Finishing a request that holds nothing (queued): the same fields as
# commit.CommitWriter, and the event schema.Event encodes. Used by CANCEL, EXPIRE and REAP.
FINISH_QUEUED = """
local function finish_queued(p, rid, reason, ttl)
  local rk, ok = ${req(rid)}, ${out(rid)}
  redis.call('HSET', rk, 'status', 'finished', 'finish_reason', reason, 'executor', '', 'blocks', '', 'swap', '')
  redis.call('SREM', ${live}, rid)
  redis.call('ZREM', ${attached}, rid)
  redis.call('EXPIRE', rk, ttl)
  redis.call('EXPIRE', ok, ttl)
  redis.call('EXPIRE', ${logprobs(rid)}, ttl)
  redis.call('EXPIRE', ${prompt_logprobs(rid)}, ttl)
  local n = redis.call('LLEN', ok)
  redis.call('XADD', ${events}, 'MAXLEN', '~', ${EVENTS_MAXLEN}, '*', 'd', ${finished_event(rid, reason, n)})
end
"""

# A frontend ends a request (abort, or a stop string it saw). Queued: finished
# here. Placed: the flag stays on the request and its loop is rung.
CANCEL = (
    FINISH_QUEUED
    + """
local p, rid, reason = ARGV[1], ARGV[2], ARGV[3]
local rk = ${req(rid)}
local f = redis.call('HMGET', rk, 'status', 'qk')
if not f[1] or f[1] == 'finished' then
  return 0
end
redis.call('HSET', rk, 'cancel', reason)
redis.call('ZREM', ${attached}, rid)
if redis.call('ZREM', ${queue}, f[2]) == 1 then
  finish_queued(p, rid, reason, ARGV[4])
else
  redis.call('XADD', ${incoming}, 'MAXLEN', '~', ${INCOMING_MAXLEN}, '*', 'op', 'cancel', 'id', rid, 'reason', reason)
end
return 1
"""
)

# A request's queue deadline (field 'dl', ms) may have passed: if it is in the shared
# queue and has not started (core/deadline.py), it finishes here with 'deadline'.
# Returns 1 if it expired now, 0 if it never will (finished, started, no deadline),
# 2 if not yet, or if a loop holds it (claimed, running, swapped): that loop expires
# what it holds, and the caller asks again a little later.
EXPIRE = (
    FINISH_QUEUED
    + """
local p, rid, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local rk = ${req(rid)}
local f = redis.call('HMGET', rk, 'status', 'qk', 'dl', 'executor')
local dl = tonumber(f[3] or '0') or 0
if not f[1] or f[1] == 'finished' or dl <= 0 or redis.call('LLEN', ${out(rid)}) > 0 then
  return 0
end
if now < dl then
  return 2
end
if f[1] == 'waiting' and (f[4] or '') == '' and redis.call('ZREM', ${queue}, f[2]) == 1 then
  redis.call('HINCRBY', ${counters}, 'finished', 1)
  finish_queued(p, rid, 'deadline', ARGV[4])
  return 1
end
return 2
"""
)

# Streams hold these requests now: refresh their attachment. Returns the ids
# Redis does not know (lost in a rollback after a crash): their frontend submits
# them again.
ATTACH = """
local p, now = ARGV[1], ARGV[2]
local missing = {}
for i = 3, #ARGV do
  local status = redis.call('HGET', ${req(ARGV[i])}, 'status')
  if not status then
    table.insert(missing, ARGV[i])
  elseif status ~= 'finished' then
    redis.call('ZADD', ${attached}, now, ARGV[i])
  end
end
return missing
"""

# The head of the queue with what placement needs of each request, and how many of each
# request's leading prompt blocks (field 'bh', its block hashes) each executor caches:
# "executor=blocks,..." (nonzero ones; codec.hits_from). The walk stops at an executor's
# first miss, so it costs about the hits it finds. Returns {rows, every pool's published view
# (HGETALL usage)}: one script call, where a pipeline of the script and HGETALL cost redis-py a
# SCRIPT EXISTS round trip each time.
PEEK = """
local p = ARGV[1]
local usage = redis.call('HGETALL', ${usage})
local execs = {}
for i = 1, #usage, 2 do
  execs[#execs + 1] = usage[i]
end
local out = {}
for i, qk in ipairs(redis.call('ZRANGE', ${queue}, 0, tonumber(ARGV[2]) - 1)) do
  local rid = ${queue_request_id(qk)}
  local f = redis.call('HMGET', ${req(rid)}, 'plen', 'maxt', 'prio', 'bh', 'lora', 'kvto')
  local hits = {}
  if f[4] and f[4] ~= '' then
    for _, e in ipairs(execs) do
      local set, n = ${x_hashes(e)}, 0
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
  out[i] = {qk, f[1] or '0', f[2] or '0', f[3] or '0', redis.call('LLEN', ${out(rid)}),
            table.concat(hits, ','), f[5] or '', f[6] or ''}
end
return {out, usage}
"""

# A loop takes queued requests for its executor: each lands on exactly one
# executor, and the queued completions of a parallel-sampling group ('grp', 'gn':
# ids "<group>#<index>") land together. Nothing is taken for a draining executor.
CLAIM = (
    FENCE
    + """
local p, eid = ARGV[3], ARGV[4]
local out = {}
if redis.call('HGET', ${member(eid)}, 'state') == 'draining' then
  return out
end
local live = ${x_live(eid)}
local function take(rid)
  local rk = ${req(rid)}
  redis.call('HSET', rk, 'executor', eid)
  redis.call('SADD', live, rid)
  table.insert(out, {rid, redis.call('HGETALL', rk), redis.call('LRANGE', ${out(rid)}, 0, -1)})
  return redis.call('HMGET', rk, 'grp', 'gn')
end
for i = 5, #ARGV do
  if redis.call('ZREM', ${queue}, ARGV[i]) == 1 then
    local rid = ${queue_request_id(ARGV[i])}
    local g = take(rid)
    if g[1] and g[1] ~= '' then
      for j = 0, tonumber(g[2]) - 1 do
        local mate = g[1] .. '#' .. j
        local qk = redis.call('HGET', ${req(mate)}, 'qk')
        if mate ~= rid and qk and redis.call('ZREM', ${queue}, qk) == 1 then
          take(mate)
        end
      end
    end
  end
end
return out
"""
)

# An executor is gone: fence its loop, send its requests back to the queue (or
# finish the cancelled ones), forget its pool (KEYS: every key of it,
# ExecutorKeys.all()), and never lead it again.
REAP = (
    FINISH_QUEUED
    + """
local p, eid, now = ARGV[1], ARGV[2], tonumber(ARGV[4])
local requeued = 0
for _, rid in ipairs(redis.call('SMEMBERS', ${x_live(eid)})) do
  local rk = ${req(rid)}
  local f = redis.call('HMGET', rk, 'status', 'cancel', 'qk', 'qs')
  if f[1] and f[1] ~= 'finished' then
    if f[2] then
      finish_queued(p, rid, f[2], ARGV[3])
    else
      redis.call('HSET', rk, 'status', 'waiting', 'executor', '', 'blocks', '', 'swap', '')
      redis.call('ZADD', ${queue}, f[4], f[3])
      requeued = requeued + 1
    end
  end
end
redis.call('DEL', unpack(KEYS))
redis.call('HDEL', ${usage}, eid)
redis.call('ZADD', ${evicted}, now, eid)
redis.call('ZREMRANGEBYSCORE', ${evicted}, '-inf', now - ${EVICTED_KEEP_MS})
redis.call('ZREM', ${members}, eid)
if requeued > 0 then
  redis.call('XADD', ${incoming}, 'MAXLEN', '~', ${INCOMING_MAXLEN}, '*', 'op', 'requeue', 'id', eid)
end
return requeued
"""
)

# The epoch is the server's clock in microseconds (and above the last one): unlike a
# counter, it never repeats after a restart that lost the last increments.
ACQUIRE = """
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

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
