"""The deployment as its shared state in Redis says, at one moment: read, built, and compared.

Nothing here asks a process for its private state: every figure is read from the
namespace's keys (``docs/architecture.md``, "Where state lives") in three round trips —
the membership (``Registry.read``, two), then one ``MULTI`` of the usage views, leases,
counters, live sets, queue and replica heartbeats, so the figures agree with each other.

- ``read(client, keys)`` fetches the raw data (``Raw``);
- ``build(raw)`` turns it into a ``Deployment`` (pure, tested with plain data);
- ``rates(before, after)`` turns two snapshots into per-second rates (pure).

``pagedserve status`` (``status.py``) prints a snapshot; ``pagedserve top`` (``top.py``) draws it.

Counters are cumulative (``steps``, preemptions, swapped blocks, per executor and for the
namespace); rates need two reads, so ``top`` shows them from one refresh to the next and
``status`` only with ``--interval``. Tokens per second come from the ``generated_tokens`` counter
(tokens sampled, per executor and for the namespace) once step commits have counted any; a
deployment that has not shows them as unknown (``null``, ``-``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.keys import Keys
from pagedserve.members import ClusterView, Member, Registry
from pagedserve.tiers import TIERS, Tier

if TYPE_CHECKING:
    import redis.asyncio as aioredis

REFUSED = "refused"  # registered, but its model does not match the namespace identity: it gets no work
DEAD = "dead"  # in the index, its record expired: a scheduler reaps it shortly
LEFT = "left"  # no membership entry (it deregistered: drained), but its loop's pool view is still published

GENERATED = "generated_tokens"  # tokens sampled; tokens/s is known only where step commits count it


def _int(v: object, default: int = 0) -> int:
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return default


# -- the snapshot ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExecutorStatus:
    """One executor: its membership record, the pool view its loop last published, its lease,
    its counters and the requests placed on it."""

    id: str
    address: str
    model: str
    state: str  # serving, draining, refused, dead, left
    leader: str | None  # replica leading its loop; None: nobody steps it right now
    block_size: int
    blocks: tuple[int, int, int]  # per tier: device, CPU, disk
    free: tuple[int, int, int] | None  # per tier; None until a loop published its pool
    running: int | None
    swapped: int | None
    max_num_seqs: int | None
    placed: int  # requests in its live set (running, swapped, or claimed and not yet admitted)
    lent: int = 0  # its lends peers have not finished reading: moves out, pre-copies, cached prefixes asked for
    fetching: int = 0  # blocks it pulls (or holds) from peers ahead of their requests: moves in, peer prefixes
    counters: dict[str, int] = field(default_factory=dict)  # cumulative; absent fields are 0
    evacuate_at_ms: int = 0  # draining: when what is left moves elsewhere
    lora: tuple[str, ...] | None = None  # --enable-lora: the adapters in its slots (names; None: LoRA off)
    role: str = "mixed"  # its --role: prefill, decode or mixed (core/disagg.py)

    def usage(self, tier: Tier = Tier.DEVICE) -> float | None:
        """Fraction of the tier's blocks in use; None when unknown or the tier is empty."""
        if self.free is None or not self.blocks[tier]:
            return None
        return (self.blocks[tier] - self.free[tier]) / self.blocks[tier]

    @property
    def kv_usage(self) -> float | None:
        return self.usage(Tier.DEVICE)

    def counter(self, name: str) -> int:
        return self.counters.get(name, 0)


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    id: str
    alive: bool  # its heartbeat deadline is in the future
    leads: tuple[str, ...]  # executors whose loop lease it holds


@dataclass(frozen=True, slots=True)
class Deployment:
    """A deployment as its Redis namespace describes it, at one moment (``build`` of one ``read``)."""

    namespace: str
    model: str
    at_ms: int  # when it was read (this machine's clock)
    executors: tuple[ExecutorStatus, ...]
    waiting: int  # requests in the shared queue
    live: int  # unfinished requests
    attached: int  # unfinished requests a stream holds
    replicas: tuple[ReplicaStatus, ...]
    totals: dict[str, int]  # namespace counters, cumulative
    counts_tokens: bool  # step commits count generated tokens (``generated``)

    def executor(self, eid: str) -> ExecutorStatus:
        (e,) = [e for e in self.executors if e.id == eid]
        return e


@dataclass(slots=True)
class Raw:
    """What Redis holds, as read: strings and counts, no interpretation."""

    namespace: str
    view: ClusterView  # membership (``Registry.read``)
    usage: dict[str, str] = field(default_factory=dict)  # executor -> pool view JSON (``{ns}:usage``)
    leaders: dict[str, str | None] = field(default_factory=dict)  # executor -> ``x:<id>:leader``
    counters: dict[str, dict[str, str]] = field(default_factory=dict)  # executor -> ``x:<id>:counters``
    placed: dict[str, int] = field(default_factory=dict)  # executor -> SCARD ``x:<id>:live``
    lent: dict[str, list[str]] = field(default_factory=dict)  # executor -> HKEYS ``x:<id>:lent``: lends, fetches
    totals: dict[str, str] = field(default_factory=dict)  # ``{ns}:counters``
    waiting: int = 0
    live: int = 0
    attached: int = 0
    replicas: list[tuple[str, float]] = field(default_factory=list)  # ``{ns}:replicas`` with scores
    loras: dict[str, str] = field(default_factory=dict)  # ``{ns}:loras``: adapter name -> JSON
    now_ms: int = 0


def _pool_view(data: str | None) -> dict:
    """A published pool view (``scheduler_svc.state.codec.view_json``); {} when absent or unreadable."""
    try:
        d = json.loads(data) if data else {}
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def _per_tier(values: object) -> tuple[int, int, int] | None:
    if not isinstance(values, (list, tuple)) or len(values) != len(TIERS):
        return None
    return tuple(_int(v) for v in values)  # type: ignore[return-value]


def _executor(eid: str, raw: Raw, member: Member | None, state: str) -> ExecutorStatus:
    """Sizes from the pool view when its loop published one (what the free counts refer to), else
    from the membership record; everything else of the view is None until a loop publishes it."""
    view = _pool_view(raw.usage.get(eid))

    def field_(name: str) -> int | None:
        return None if view.get(name) is None else _int(view[name])

    blocks = _per_tier(view.get("blocks")) or (member.blocks if member else (0, 0, 0))
    return ExecutorStatus(
        id=eid,
        address=member.address if member else "",
        model=member.model if member else "",
        state=state,
        leader=raw.leaders.get(eid) or None,
        block_size=member.block_size if member else _int(view.get("block_size")),
        blocks=blocks,
        free=_per_tier(view.get("free")),
        running=field_("running"),
        swapped=field_("swapped"),
        max_num_seqs=field_("max_num_seqs"),
        placed=raw.placed.get(eid, 0),
        lent=sum(not k.startswith("fetch/") for k in raw.lent.get(eid, [])),
        fetching=sum(k.startswith("fetch/") for k in raw.lent.get(eid, [])),
        counters={k: _int(v) for k, v in raw.counters.get(eid, {}).items()},
        evacuate_at_ms=member.evacuate_at_ms if member else 0,
        lora=_adapters(member, raw.loras) if member and member.lora_slots else None,
        role=member.role if member else "mixed",
    )


def _adapters(member: Member, loras: dict[str, str]) -> tuple[str, ...]:
    """The names its resident adapters are registered under (a digest's first 12 digits if none)."""
    names: dict[str, list[str]] = {}
    for name, text in loras.items():
        try:
            names.setdefault(str(json.loads(text).get("digest")), []).append(name)
        except (ValueError, AttributeError):
            continue
    return tuple("|".join(sorted(names.get(d, []))) or d[:12] for d in member.lora_resident)


def build(raw: Raw) -> Deployment:
    """The snapshot ``raw`` describes. Executors in membership order (registration time), then
    expired records, then published pool views without a membership entry (``left``)."""
    view = raw.view
    out: list[ExecutorStatus] = []
    for eid, m in view.members.items():
        state = REFUSED if view.identity and not m.matches(view.identity) else m.state
        out.append(_executor(eid, raw, m, state))
    seen = set(view.members)
    for eid in view.dead:
        if eid not in seen:
            seen.add(eid)
            out.append(_executor(eid, raw, None, DEAD))
    for eid in sorted(raw.usage):
        if eid not in seen:
            seen.add(eid)
            out.append(_executor(eid, raw, None, LEFT))
    leads: dict[str, list[str]] = {}
    for e in out:
        if e.leader:
            leads.setdefault(e.leader, []).append(e.id)
    deadlines = dict(raw.replicas)
    replicas = [
        ReplicaStatus(r, deadlines.get(r, 0) > raw.now_ms, tuple(sorted(leads.get(r, ()))))
        for r in sorted(set(deadlines) | set(leads))
    ]
    model = view.identity.get("model") or next((m.model for m in view.members.values()), "")
    counts_tokens = GENERATED in raw.totals or any(GENERATED in c for c in raw.counters.values())
    return Deployment(
        namespace=raw.namespace,
        model=model,
        at_ms=raw.now_ms,
        executors=tuple(out),
        waiting=raw.waiting,
        live=raw.live,
        attached=raw.attached,
        replicas=tuple(replicas),
        totals={k: _int(v) for k, v in raw.totals.items()},
        counts_tokens=counts_tokens,
    )


# -- rates ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rate:
    steps_per_s: float | None
    tokens_per_s: float | None  # None: the commits do not count tokens, or a counter went back
    preemptions_per_s: float | None


def _rate(before: Mapping[str, int], after: Mapping[str, int], names: tuple[str, ...], dt: float) -> float | None:
    d = sum(after.get(n, 0) for n in names) - sum(before.get(n, 0) for n in names)
    return None if d < 0 or dt <= 0 else d / dt


def rate_of(before: Mapping[str, int], after: Mapping[str, int], dt: float, counts_tokens: bool) -> Rate:
    """Rates of cumulative counters ``before`` and ``after``, ``dt`` seconds apart."""
    return Rate(
        _rate(before, after, ("steps",), dt),
        _rate(before, after, (GENERATED,), dt) if counts_tokens else None,
        _rate(before, after, ("preemptions_swap", "preemptions_recompute"), dt),
    )


def rates(before: Deployment, after: Deployment) -> tuple[dict[str, Rate], Rate]:
    """Per-second rates between two snapshots: per executor present in both, and for the namespace.
    An executor's counters start over when it is reaped and rejoins under a new id; a counter that
    went down gives None rather than a negative rate."""
    dt = (after.at_ms - before.at_ms) / 1000
    prev = {e.id: e for e in before.executors}
    per = {
        e.id: rate_of(prev[e.id].counters, e.counters, dt, after.counts_tokens) for e in after.executors if e.id in prev
    }
    return per, rate_of(before.totals, after.totals, dt, after.counts_tokens)


# -- reading Redis -----------------------------------------------------------------


def _now_ms() -> int:
    return int(time.time() * 1000)


async def read_raw(client: aioredis.Redis, keys: Keys) -> Raw:
    """Three round trips: the membership (two), then one MULTI of everything else."""
    view = await Registry(client, keys).read()
    ids = list(dict.fromkeys([*view.members, *view.dead]))
    raw = Raw(keys.namespace, view)

    def per_executor(pipe: aioredis.client.Pipeline, eids: list[str]) -> None:
        for eid in eids:
            x = keys.executor(eid)
            pipe.get(x.leader)
            pipe.hgetall(x.counters)
            pipe.scard(x.live)
            pipe.hkeys(x.lent)

    def take(got: list, eids: list[str]) -> None:
        for i, eid in enumerate(eids):
            raw.leaders[eid], raw.counters[eid], raw.placed[eid] = got[4 * i], got[4 * i + 1], int(got[4 * i + 2])
            raw.lent[eid] = [k.decode() if isinstance(k, bytes) else k for k in got[4 * i + 3]]

    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.usage)
    pipe.hgetall(keys.counters)
    pipe.zcard(keys.queue)
    pipe.scard(keys.live)
    pipe.zcard(keys.attached)
    pipe.zrange(keys.replicas, 0, -1, withscores=True)
    pipe.hgetall(keys.loras)
    per_executor(pipe, ids)
    got = await pipe.execute()
    raw.now_ms = _now_ms()
    raw.usage, raw.totals = got[0], got[1]
    raw.waiting, raw.live, raw.attached = int(got[2]), int(got[3]), int(got[4])
    raw.replicas = [(r, float(s)) for r, s in got[5]]
    raw.loras = got[6]
    take(got[7:], ids)
    extra = [e for e in raw.usage if e not in raw.placed]
    if extra:  # a published pool with no membership entry: rare, one more round trip
        pipe = client.pipeline(transaction=True)
        per_executor(pipe, extra)
        take(await pipe.execute(), extra)
    return raw


async def read(client: aioredis.Redis, keys: Keys) -> Deployment:
    return build(await read_raw(client, keys))


def connect(url: str) -> aioredis.Redis:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
