"""Executor membership: the record each executor keeps in Redis, and reading them all.

An executor started with ``--redis-url`` registers itself: its record
(``{ns}:exec:<instance_id>``, a hash with a heartbeat TTL) says where to reach
it, what it serves and how large its pools are, and whether it is ``serving``
or ``draining``. It writes only that record and its own entry in the index
``{ns}:executors``. Schedulers read every record; a record whose TTL ran out
is a dead executor, which any scheduler replica reaps.

The namespace's identity (model digest, block size, dtype) is fixed by the
first executor a scheduler adopts; an executor that disagrees is refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from pagedserve.executor.v1 import executor_pb2 as epb
from pagedserve.keys import INCOMING_MAXLEN, Keys

SERVING, DRAINING = "serving", "draining"
ROLES = ("mixed", "prefill", "decode")  # --role: what an executor takes (docs/architecture.md, "Prefill and decode")

# Register or renew: refused once the instance was evicted; keeps the first
# registration time in the index; returns the namespace identity.
_REGISTER = """
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  return 'evicted'
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], 'NX', ARGV[3], ARGV[1])
return redis.call('HGETALL', KEYS[4])
"""

# Fix the namespace identity if none is set yet; returns the one in force.
_IDENTITY = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
end
return redis.call('HGETALL', KEYS[1])
"""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class Member:
    instance_id: str
    address: str
    model: str
    model_digest: str
    dtype: str
    block_size: int
    blocks: tuple[int, int, int]  # per tier: device, CPU, disk
    max_model_len: int
    state: str = SERVING
    evacuate_at_ms: int = 0  # draining: from then on its loop moves what is left elsewhere
    static: bool = False  # configured with the scheduler's --executor, registered by schedulers
    model_path: str = ""  # the model directory the executor loaded ("" from an executor that predates it)
    # --enable-lora: its adapter slots, and the digests in them and in its host cache (pagedserve/lora.py)
    lora_slots: int = 0
    lora_resident: tuple[str, ...] = ()
    lora_cached: tuple[str, ...] = ()
    role: str = "mixed"  # --role (ROLES)

    @property
    def identity(self) -> dict[str, str]:
        return {
            "model_digest": self.model_digest,
            "block_size": str(self.block_size),
            "dtype": self.dtype,
            "model": self.model,
        }

    def matches(self, identity: dict[str, str]) -> bool:
        mine = self.identity
        return all(identity.get(k) == mine[k] for k in ("model_digest", "block_size", "dtype"))

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    def to_fields(self) -> dict[str, str]:
        return (
            {
                "address": self.address,
                "model": self.model,
                "model_digest": self.model_digest,
                "dtype": self.dtype,
                "block_size": str(self.block_size),
                "blocks": ",".join(map(str, self.blocks)),
                "max_model_len": str(self.max_model_len),
                "state": self.state,
                "evacuate_at_ms": str(self.evacuate_at_ms),
                "static": "1" if self.static else "0",
                "model_path": self.model_path,
            }
            | (self._lora_field() if self.lora_slots else {})
            | ({"role": self.role} if self.role != "mixed" else {})
        )

    def _lora_field(self) -> dict[str, str]:
        """Only with --enable-lora: a record without it reads as it did before adapters."""
        lora = {"slots": self.lora_slots, "resident": list(self.lora_resident), "cached": list(self.lora_cached)}
        return {"lora": json.dumps(lora)}

    @classmethod
    def from_fields(cls, instance_id: str, f: dict[str, str]) -> Member:
        d, c, k = (int(x) for x in f["blocks"].split(","))
        return cls(
            instance_id,
            f["address"],
            f["model"],
            f["model_digest"],
            f["dtype"],
            int(f["block_size"]),
            (d, c, k),
            int(f["max_model_len"]),
            f["state"],
            int(f.get("evacuate_at_ms", 0)),
            f.get("static") == "1",
            f.get("model_path", ""),
            *_lora_of(f.get("lora")),
            f.get("role") or "mixed",
        )

    @classmethod
    def from_info(cls, info: epb.InfoResponse, address: str, static: bool = False) -> Member:
        return cls(
            info.instance_id,
            address,
            info.model,
            info.model_digest,
            info.dtype,
            info.block_size,
            (info.num_gpu_blocks, info.num_cpu_blocks, info.num_disk_blocks),
            info.max_model_len,
            info.state or SERVING,
            info.evacuate_at_ms,
            static,
            info.model_path,
            role=info.role or "mixed",
        )


def _lora_of(text: str | None) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    if not text:
        return 0, (), ()
    d = json.loads(text)
    return int(d["slots"]), tuple(d["resident"]), tuple(d["cached"])


def describe_mismatch(member: Member, identity: dict[str, str]) -> str:
    return (
        f"executor {member.instance_id} at {member.address} serves {member.model} "
        f"(digest {member.model_digest}, block size {member.block_size}, {member.dtype}) but namespace serves "
        f"{identity.get('model')} (digest {identity.get('model_digest')}, block size "
        f"{identity.get('block_size')}, {identity.get('dtype')}): refused"
    )


@dataclass(slots=True)
class ClusterView:
    """Membership as one read saw it."""

    members: dict[str, Member] = field(default_factory=dict)  # live records, evicted ones excluded
    dead: list[str] = field(default_factory=list)  # in the index, but the record expired
    identity: dict[str, str] = field(default_factory=dict)
    replicas: int = 0  # scheduler replicas with a live heartbeat

    def compatible(self) -> list[Member]:
        """Members that may take work: they match the namespace identity (or none is set yet)."""
        return [m for m in self.members.values() if not self.identity or m.matches(self.identity)]

    def serving(self) -> list[Member]:
        return [m for m in self.compatible() if m.serving]


class Registry:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.r = client
        self.keys = keys
        self._register = client.register_script(_REGISTER)
        self._identity = client.register_script(_IDENTITY)

    async def register(self, member: Member, ttl_ms: int) -> dict[str, str] | None:
        """Write or renew ``member``'s record; None once it has been evicted, else the namespace identity."""
        k = self.keys
        fields = [x for kv in member.to_fields().items() for x in kv]
        got = await self._register(
            keys=[k.member(member.instance_id), k.members, k.evicted, k.identity],
            args=[member.instance_id, ttl_ms, now_ms(), *fields],
        )
        if got == "evicted":
            return None
        return dict(zip(got[::2], got[1::2]))

    async def deregister(self, instance_id: str) -> None:
        """Delete the record; its index entry stays, so that a scheduler sees a dead member
        and reaps whatever state of it is left (the executor writes nothing else)."""
        await self.r.delete(self.keys.member(instance_id))

    async def fix_identity(self, member: Member) -> dict[str, str]:
        """The namespace identity, set from ``member`` if there is none yet."""
        got = await self._identity(keys=[self.keys.identity], args=[x for kv in member.identity.items() for x in kv])
        return dict(zip(got[::2], got[1::2]))

    async def ring_drain(self, instance_id: str) -> None:
        """Tell the loops at once that this executor drains (a ``drain`` doorbell): its loop starts moving
        its requests now instead of at the next membership read."""
        await self.r.xadd(
            self.keys.incoming, {"op": "drain", "id": instance_id}, maxlen=INCOMING_MAXLEN, approximate=True
        )

    async def placed(self, instance_id: str) -> int:
        """Requests still placed on an executor (what a draining executor waits for)."""
        return int(await self.r.scard(self.keys.executor(instance_id).live))

    async def beat_replica(self, replica: str, ttl_ms: int) -> None:
        now = now_ms()
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self.keys.replicas, {replica: now + ttl_ms})
        pipe.zremrangebyscore(self.keys.replicas, "-inf", now - 60_000)
        await pipe.execute()

    async def leave_replica(self, replica: str) -> None:
        await self.r.zrem(self.keys.replicas, replica)

    async def read(self) -> ClusterView:
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        pipe.zrange(k.members, 0, -1)
        pipe.zrange(k.evicted, 0, -1)
        pipe.hgetall(k.identity)
        pipe.zcount(k.replicas, now_ms(), "+inf")
        ids, evicted, identity, replicas = await pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        for eid in ids:
            pipe.hgetall(k.member(eid))
        view = ClusterView(identity=identity, replicas=int(replicas))
        gone = set(evicted)
        for eid, fields in zip(ids, await pipe.execute()):
            if not fields:
                view.dead.append(eid)
            elif eid not in gone:
                view.members[eid] = Member.from_fields(eid, fields)
        return view
