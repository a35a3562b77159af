"""Pure mappings between the scheduler's objects and Redis: request hashes, the
queue's entries, one step's operations, the events frontends read, pool views.

Nothing here talks to Redis: ``CommitWriter.ops`` returns the commands a step
commits (``RedisStore.apply`` runs them in one fenced Lua call), and the Lua
scripts in ``lua.py`` that write the same fields follow the same shapes
(tests check the two against each other on a real server). Key names, the
queue members' layout, stream lengths and the event format are ``schema``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from pagedserve.keys import Keys
from pagedserve.tiers import TIERS, Tier
from scheduler_svc.core.placement import Candidate, PoolView
from scheduler_svc.core.record import CacheDelta, StepRecord
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.state.schema import (
    BITS,
    EVENTS_MAXLEN,
    FILL,
    INCOMING_MAXLEN,
    MAX_OP_ARGS,
    RESULT_TTL_S,
    Event,
    queue_member,
    request_id_of,
)

# -- requests -------------------------------------------------------------------


def spec_json(req: Request, stop: list[str]) -> str:
    """The immutable part of a request."""
    p = req.params
    params: dict[str, object] = {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "seed": p.seed,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
    }
    # The newer options only when set: a spec keeps the shape older replicas read.
    params.update({k: getattr(p, k) for k, default in _EXTRA_DEFAULTS.items() if getattr(p, k) != default})
    if p.logit_bias:
        params["logit_bias"] = [list(x) for x in p.logit_bias]
    if p.grammar:
        params["grammar"] = list(p.grammar)
    extra: dict[str, object] = {"salt": req.cache_salt} if req.cache_salt else {}
    if req.group:
        extra["group"] = [req.group, req.index]
    return json.dumps({"prompt": req.prompt_ids, "priority": req.priority, "stop": stop, **extra, "params": params})


_EXTRA_DEFAULTS: dict[str, object] = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "n": 1,
}


def request_from(request_id: str, fields: dict[str, str], output: list[str], computed: int = 0) -> Request:
    spec = json.loads(fields["spec"])
    params = spec["params"]
    params["stop_token_ids"] = tuple(params["stop_token_ids"])
    params["logit_bias"] = tuple((int(t), float(b)) for t, b in params.get("logit_bias", ()))
    if params.get("grammar"):
        params["grammar"] = tuple(params["grammar"])
    group, index = spec.get("group", ("", 0))
    return Request(
        request_id=request_id,
        prompt_ids=spec["prompt"],
        params=Params(**params),
        priority=spec["priority"],
        arrival=int(fields.get("arrival", 0)),
        output_ids=[int(t) for t in output],
        status=Status(fields.get("status", Status.WAITING)),
        num_computed=computed,
        blocks=[int(b) for b in fields.get("blocks", "").split(",") if b],
        swap_blocks=[(Tier(int(t)), int(b)) for t, b in (x.split(":") for x in fields.get("swap", "").split(",") if x)],
        num_preemptions=int(fields.get("preemptions", 0)),
        deadline_ms=int(fields.get("dl") or 0),
        cache_salt=spec.get("salt"),
        num_cached=int(fields.get("cached") or 0),
        group=group,
        index=index,
    )


def stop_of(fields: dict[str, str]) -> list[str]:
    """The request's stop strings (the frontend applies them)."""
    return list(json.loads(fields["spec"])["stop"])


@dataclass(slots=True)
class Claimed:
    """A request a loop took from the queue, as the claim script returned it."""

    req: Request
    cancel: Finish | None  # a frontend's pending abort or stop
    submitted_ms: int  # when it was submitted
    traceparent: str  # its root span, if tracing is on


def cancel_of(fields: dict[str, str]) -> Finish | None:
    """A frontend's pending ``abort`` or ``stop`` for this request, if any."""
    return Finish(fields["cancel"]) if fields.get("cancel") else None


def queue_entry(arrival: int, request_id: str, priority: int, policy: str) -> tuple[float, str]:
    """(score, member) in the shared queue: members sort by arrival (schema.queue_member,
    as the submit script writes them), scores by priority under the priority policy."""
    return (float(priority) if policy == "priority" else 0.0), queue_member(arrival, request_id)


def hashes_field(hashes: list[str]) -> str:
    """A request's prompt block hashes (core/prefix.prompt_hashes) as the submit script stores them."""
    return ",".join(hashes)


def hits_from(text: str) -> dict[str, int]:
    """The peek script's ``executor=blocks,...``: how many of a request's leading blocks each executor caches."""
    out: dict[str, int] = {}
    for item in text.split(",") if text else []:
        executor, _, n = item.rpartition("=")
        out[executor] = int(n)
    return out


def candidate_from(row: list[str]) -> Candidate:
    """A row of the peek script: queue key, prompt length, max_tokens, priority, tokens generated, and
    the prefix hits per executor (``hits_from``)."""
    qk, plen, maxt, prio, nout, *rest = row
    return Candidate(
        qk,
        request_id_of(qk),
        int(plen),
        int(plen) + int(nout),
        int(maxt),
        int(prio),
        hits_from(rest[0] if rest else ""),
    )


# -- events ---------------------------------------------------------------------


def event_of(rec: StepRecord) -> Event:
    ev = Event()
    ended = {r.request_id: r for r in rec.finished}
    for rid, toks in rec.new_tokens.items():
        req = rec.touched.get(rid) or ended[rid]
        ev.tokens[rid] = (len(req.output_ids) - len(toks), toks)
    ev.logprobs = dict(rec.logprobs)
    for r in rec.finished:
        ev.finished[r.request_id] = ((r.finish_reason or Finish.ABORT).value, len(r.output_ids))
        if r.num_cached:
            ev.cached[r.request_id] = r.num_cached
    return ev


def entry_json(entry: object) -> str:
    """A logprobs entry (``plan.entry``) as stored in Redis."""
    return json.dumps(entry, separators=(",", ":"))


# -- pool views -----------------------------------------------------------------


def view_json(v: PoolView) -> str:
    return json.dumps(
        {
            "serving": v.serving,
            "block_size": v.block_size,
            "blocks": v.blocks,
            "free": v.free,
            "running": v.running,
            "swapped": v.swapped,
            "max_model_len": v.max_model_len,
            "max_num_seqs": v.max_num_seqs,
            "watermark": v.watermark,
            "held": {str(p): n for p, n in v.held.items()},
        },
        separators=(",", ":"),
    )


def view_from(executor: str, data: str) -> PoolView:
    d = json.loads(data)
    return PoolView(
        executor,
        d["serving"],
        d["block_size"],
        tuple(d["blocks"]),
        tuple(d["free"]),
        d["running"],
        d["swapped"],
        d["max_model_len"],
        d["max_num_seqs"],
        d["watermark"],
        {int(p): n for p, n in d["held"].items()},
    )


# -- one step's commit ------------------------------------------------------------


def _chunks(cmd: str, key: str, values: list[str]) -> list[list[str]]:
    return [[cmd, key, *values[i : i + MAX_OP_ARGS]] for i in range(0, len(values), MAX_OP_ARGS)]


def free_blocks(bitmap: bytes, total: int) -> list[int]:
    """The free block ids a tier's bitmap holds (bit ``b``, most significant first in each byte)."""
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8))[:total]
    return np.flatnonzero(bits).tolist()


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
            ["DEL", self.x.pool, self.x.computed, self.x.cache, self.x.lru, self.x.hashes],
            ["HSET", self.x.pool, "blocks", ",".join(map(str, totals)), "block_size", str(block_size)],
            ["SET", self.x.seq, str(seq)],
        ]
        return ops + [[FILL, self.x.free(tier), str(total)] for tier, total in zip(TIERS, totals)]

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
        ops: list[list[str]] = []
        for req in rec.requeued:
            rid = req.request_id
            self._saved.pop(rid, None)
            score, member = queue_entry(req.arrival, rid, req.priority, self.policy)
            ops += [
                [
                    "HSET",
                    self.k.req(rid),
                    "status",
                    Status.WAITING.value,
                    "executor",
                    "",
                    "blocks",
                    "",
                    "swap",
                    "",
                    "preemptions",
                    str(req.num_preemptions),
                ],
                ["SREM", self.x.live, rid],
                ["HDEL", self.x.computed, rid],
                ["ZADD", self.k.queue, repr(score), member],
            ]
        for req in rec.finished:
            rid = req.request_id
            self._saved.pop(rid, None)
            ops += [
                [
                    "HSET",
                    self.k.req(rid),
                    "status",
                    Status.FINISHED.value,
                    "executor",
                    self.executor,
                    "finish_reason",
                    (req.finish_reason or Finish.ABORT).value,
                    "blocks",
                    "",
                    "swap",
                    "",
                    "cached",
                    str(req.num_cached),
                ],
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
        if rec.requeued:
            ops.append(
                [
                    "XADD",
                    self.k.incoming,
                    "MAXLEN",
                    "~",
                    str(INCOMING_MAXLEN),
                    "*",
                    "op",
                    "requeue",
                    "id",
                    rec.requeued[0].request_id,
                ]
            )
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
