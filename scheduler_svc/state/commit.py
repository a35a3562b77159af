"""One step's commit: ``CommitWriter.ops`` turns what a step changed (``StepRecord``) into the
Redis commands ``RedisStore.apply`` runs in one fenced Lua call (``lua.APPLY``), field by field
in the shapes ``codec`` reads back. Nothing here talks to Redis."""

from __future__ import annotations

from pagedserve.keys import Keys
from pagedserve.tiers import TIERS
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.record import CacheDelta, StepRecord
from scheduler_svc.core.request import Finish, Request, Status
from scheduler_svc.state.codec import (
    ask_json,
    entry_json,
    event_of,
    kv_json,
    lent_json,
    offer_json,
    queue_entry,
    view_json,
)
from scheduler_svc.state.schema import (
    BITS,
    EVENTS_MAXLEN,
    FILL,
    INCOMING_MAXLEN,
    MAX_OP_ARGS,
    RESULT_TTL_S,
)


def _chunks(cmd: str, key: str, values: list[str]) -> list[list[str]]:
    return [[cmd, key, *values[i : i + MAX_OP_ARGS]] for i in range(0, len(values), MAX_OP_ARGS)]


def _signature(req: Request) -> tuple[object, ...]:
    """The part of a request's hash that changes only on transitions and new blocks."""
    return (req.status, len(req.blocks), tuple(req.swap_blocks), req.num_preemptions, req.num_cached)


class CommitWriter:
    """Maps one executor's step records to Redis commands.

    It remembers what it last wrote of each request's hash, so that a decode
    step rewrites only requests whose status or block tables changed; a new
    leader starts a fresh writer (``restore`` seeds it with what it loaded).
    """

    def __init__(self, keys: Keys, executor: str, policy: str, result_ttl: int = RESULT_TTL_S) -> None:
        self.k = keys
        self.x = keys.executor(executor)
        self.executor = executor
        self.policy = policy
        self.result_ttl = str(result_ttl)
        self._saved: dict[str, tuple[object, ...]] = {}

    def saw(self, requests: list[Request]) -> None:
        self._saved = {r.request_id: _signature(r) for r in requests}

    def reset_ops(self, totals: tuple[int, ...], block_size: int, seq: int) -> list[list[str]]:
        """Bind the state to a fresh pool: every block free, nothing computed; the write
        sequence goes to ``seq`` (at least what the executor has executed)."""
        ops: list[list[str]] = [
            ["DEL", self.x.pool, self.x.computed, self.x.cache, self.x.lru, self.x.hashes, self.x.lent, self.x.moving],
            ["HSET", self.x.pool, "blocks", ",".join(map(str, totals)), "block_size", str(block_size)],
            ["SET", self.x.seq, str(seq)],
        ]
        return ops + [[FILL, self.x.free(tier), str(total)] for tier, total in zip(TIERS, totals)]

    def moving(self, seq: int) -> list[str]:
        """Record that the state holds the swaps or copies of the plan with ``seq``, whose result is not in
        (``ExecutorKeys.moving``); 0: none."""
        return ["SET", self.x.moving, str(seq)] if seq else ["DEL", self.x.moving]

    def _blocks(self, rec: StepRecord, is_free: object) -> list[list[str]]:
        ops: list[list[str]] = []
        for tier, changed in zip(TIERS, rec.changed):
            freed = [str(b) for b in changed if is_free(tier, b)]  # type: ignore[operator]
            owned = [str(b) for b in changed if not is_free(tier, b)]  # type: ignore[operator]
            ops += [[BITS, self.x.free(tier), "1", ",".join(freed)]] if freed else []
            ops += [[BITS, self.x.free(tier), "0", ",".join(owned)]] if owned else []
        return ops + self._cache(rec.cache)

    def _cache(self, d: CacheDelta) -> list[list[str]]:
        """The prefix cache's state (``pagedserve.keys``: cache, lru, hashes)."""
        x = self.x
        ops = _chunks("HDEL", x.cache, [str(b) for b in d.unhashed])
        ops += _chunks("HSET", x.cache, [v for b, h in d.hashed.items() for v in (str(b), h)])
        ops += _chunks("ZREM", x.lru, [str(b) for b in d.held])
        ops += _chunks("ZADD", x.lru, [v for b, r in d.evictable.items() for v in (str(r), str(b))])
        ops += _chunks("SREM", x.hashes, d.dropped)
        return ops + _chunks("SADD", x.hashes, d.added)

    def _requests(self, rec: StepRecord, in_flight: dict[str, int]) -> list[list[str]]:
        ops: list[list[str]] = []
        computed: list[str] = []
        gone = {r.request_id for r in rec.requeued}
        for rid, req in rec.touched.items():
            if req.status == Status.FINISHED or rid in gone:
                continue
            computed += (rid, str(in_flight.get(rid, req.num_computed)))
            sig = _signature(req)
            if self._saved.get(rid) == sig:
                continue
            self._saved[rid] = sig
            ops.append(
                [
                    "HSET",
                    self.k.req(rid),
                    "status",
                    req.status.value,
                    "executor",
                    self.executor,
                    "blocks",
                    ",".join(map(str, req.blocks)),
                    "swap",
                    ",".join(f"{int(t)}:{b}" for t, b in req.swap_blocks),
                    "preemptions",
                    str(req.num_preemptions),
                    "cached",
                    str(req.num_cached),
                ]
            )
        if computed:
            ops += _chunks("HSET", self.x.computed, computed)
        return ops

    def _leaving(self, rec: StepRecord) -> list[list[str]]:
        """Requests that leave this executor: back to the shared queue, or finished."""
        ops: list[list[str]] = []
        for req in rec.requeued:
            self._saved.pop(req.request_id, None)
            ops += self._requeue(req)
        for req in rec.finished:
            self._saved.pop(req.request_id, None)
            ops += self._finish(req)
        ops += self._moves(rec)
        if rec.requeued:  # one doorbell for every loop: work is queued
            ring = ["XADD", self.k.incoming, "MAXLEN", "~", str(INCOMING_MAXLEN), "*"]
            ops.append([*ring, "op", "requeue", "id", rec.requeued[0].request_id])
        return ops

    def _requeue(self, req: Request) -> list[list[str]]:
        rid = req.request_id
        score, member = queue_entry(req.arrival, rid, req.priority, self.policy)
        fields = {"status": Status.WAITING.value, "executor": "", "blocks": "", "swap": ""}
        kv = (
            ["HSET", self.k.req(rid), "kv", kv_json(req.kv), "kvto", req.kv.to]
            if req.kv
            else ["HDEL", self.k.req(rid), "kv", "kvto"]
        )
        return [
            ["HSET", self.k.req(rid), *_flat(fields), "preemptions", str(req.num_preemptions)],
            kv,
            ["SREM", self.x.live, rid],
            ["HDEL", self.x.computed, rid],
            ["ZADD", self.k.queue, repr(score), member],
        ]

    def _moves(self, rec: StepRecord) -> list[list[str]]:
        """KV migration (core/migration.py): lends made and ended here, and for each pull done here
        the request forgets its source and the source's loop hears that its lend can end."""
        ops = _chunks("HSET", self.x.lent, [v for x in rec.lent for v in (x.lend_id, lent_json(x))])
        ops += _chunks("HDEL", self.x.lent, rec.unlent)
        ring = ["XADD", self.k.incoming, "MAXLEN", "~", str(INCOMING_MAXLEN), "*"]
        for req, src in rec.pulled:
            ops += [["HDEL", self.k.req(req.request_id), "kv", "kvto"], [*ring, "op", "unlend", "id", src.lend]]
        ops += [[*ring, "op", "unlend", "id", lend_id] for lend_id in rec.rung]
        ops += [[*ring, "op", "offer", "id", o.request_id, "to", o.to, "d", offer_json(o)] for o in rec.offers]
        ops += [[*ring, "op", "ask", "id", a.request_id, "to", a.to, "d", ask_json(a)] for a in rec.asks]
        return ops

    def _finish(self, req: Request) -> list[list[str]]:
        rid = req.request_id
        fields = {
            "status": Status.FINISHED.value,
            "executor": self.executor,
            "finish_reason": (req.finish_reason or Finish.ABORT).value,
            "blocks": "",
            "swap": "",
            "cached": str(req.num_cached),
        }
        ops = [
            ["HSET", self.k.req(rid), *_flat(fields)],
            ["SREM", self.x.live, rid],
            ["SREM", self.k.live, rid],
            ["HDEL", self.x.computed, rid],
            ["ZREM", self.k.attached, rid],
            ["EXPIRE", self.k.req(rid), self.result_ttl],
            ["EXPIRE", self.k.out(rid), self.result_ttl],
        ]
        if req.params.logprobs is not None:
            ops.append(["EXPIRE", self.k.logprobs(rid), self.result_ttl])
        if req.params.prompt_logprobs is not None:
            ops.append(["EXPIRE", self.k.prompt_logprobs(rid), self.result_ttl])
        return ops

    def ops(
        self, rec: StepRecord, is_free: object, view: PoolView | None = None, in_flight: dict[str, int] | None = None
    ) -> list[list[str]]:
        """Everything ``rec`` changed; ``is_free(tier, block)`` is the block manager's.
        ``view``: this pool's usage for placement, written when given. ``in_flight``: the
        requests of a launched plan whose result is not in, with its first position: what
        they have computed for sure (the pipelined loop commits a step while the next runs)."""
        ops = self._blocks(rec, is_free) + self._requests(rec, in_flight or {})
        for rid, toks in rec.new_tokens.items():
            ops.append(["RPUSH", self.k.out(rid), *map(str, toks)])
        for rid, entries in rec.logprobs.items():
            ops.append(["RPUSH", self.k.logprobs(rid), *map(entry_json, entries)])
        for rid, by_pos in rec.prompt_logprobs.items():
            ops += _chunks(
                "HSET",
                self.k.prompt_logprobs(rid),
                [x for pos, e in sorted(by_pos.items()) for x in (str(pos), entry_json(e))],
            )
        ops += self._leaving(rec)
        event = event_of(rec)
        if event:
            ops.append(["XADD", self.k.events, "MAXLEN", "~", str(EVENTS_MAXLEN), "*", "d", event.encode()])
        for name, n in rec.counters.nonzero().items():
            ops += [["HINCRBY", self.x.counters, name, str(n)], ["HINCRBY", self.k.counters, name, str(n)]]
        if view is not None:
            ops.append(["HSET", self.k.usage, self.executor, view_json(view)])
        return ops


def _flat(fields: dict[str, str]) -> list[str]:
    """A hash's fields as HSET's arguments, in order."""
    return [word for item in fields.items() for word in item]
