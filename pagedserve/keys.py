"""The Redis key scheme of one pagedserve namespace, shared by both services.

Every key carries the hash tag ``{ns}``, so a Redis Cluster keeps a whole
namespace in one slot and a Lua script may touch any of its keys. Three kinds:

- namespace keys: the request queue, requests, events, membership;
- per-executor keys (``{ns}:x:<instance_id>:…``): one block pool, its live
  requests and the lease of the loop that steps it, written only by that loop
  (and deleted by whoever reaps the executor);
- membership records (``{ns}:exec:<instance_id>``), each written only by its
  executor (or, for a statically configured executor, by the schedulers).

``docs/architecture.md`` lists every key with its type and invariants. The names
are written here only: the scheduler's Lua scripts get them rendered in from
these builders (``scheduler_svc/state/schema.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.tiers import Tier

INCOMING_MAXLEN = 10_000  # the doorbell stream ({ns}:incoming) is capped at about this many entries


@dataclass(frozen=True, slots=True)
class ExecutorKeys:
    prefix: str  # "{ns}:x:<instance_id>:"

    @property
    def live(self) -> str:
        """Set: ids of the requests placed on this executor."""
        return self.prefix + "live"

    @property
    def computed(self) -> str:
        """Hash: request id -> tokens whose KV is cached on this executor."""
        return self.prefix + "computed"

    @property
    def pool(self) -> str:
        """Hash: ``blocks`` (per tier) and ``block_size`` the free sets were built for."""
        return self.prefix + "pool"

    @property
    def counters(self) -> str:
        return self.prefix + "counters"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def epoch(self) -> str:
        return self.prefix + "epoch"

    @property
    def seq(self) -> str:
        """Writes of this state so far: each fenced write checks and increments it, so a write
        on top of state that Redis lost (a restart from an older AOF) is refused."""
        return self.prefix + "seq"

    @property
    def cache(self) -> str:
        """Hash: device block -> hex hash of every cached block (held or evictable): the prefix
        cache a new leader reloads."""
        return self.prefix + "cache"

    @property
    def lru(self) -> str:
        """Sorted set: cached blocks nobody holds (evictable) -> LRU rank; the lowest is evicted first."""
        return self.prefix + "lru"

    @property
    def hashes(self) -> str:
        """Set: the hex hashes cached on this executor (what prefix-aware placement reads)."""
        return self.prefix + "hashes"

    @property
    def lent(self) -> str:
        """Hash: lend id -> JSON {request, blocks, deadline}: blocks of requests that left with their KV,
        held until the destination has read them (scheduler_svc/core/migration.py)."""
        return self.prefix + "lent"

    @property
    def moving(self) -> str:
        """String: the seq of a plan whose swaps or copies the state records before its result came back
        (absent when none): a new leader whose executor has not applied that seq resets the pool, since
        those moves may never have run (scheduler_svc/loops/flights.py, core/restore.py)."""
        return self.prefix + "moving"

    def free(self, tier: Tier | int) -> str:
        """The tier's free set, as a bitmap: bit ``b`` is 1 while block ``b`` is free. A pool of
        hundreds of thousands of blocks is a few tens of KiB, set whole in one command."""
        return f"{self.prefix}free:{int(tier)}"

    def all(self) -> list[str]:
        """Every key of this executor's state."""
        return [
            self.live,
            self.computed,
            self.pool,
            self.counters,
            self.leader,
            self.epoch,
            self.seq,
            self.cache,
            self.lru,
            self.hashes,
            self.lent,
            self.moving,
            *(self.free(t) for t in Tier),
        ]


class Keys:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.prefix = p = "{" + namespace + "}:"
        self.identity = p + "model"  # hash: model_digest, block_size, dtype, model of the namespace
        self.members = p + "executors"  # zset: instance id -> registration time (ms)
        self.evicted = p + "evicted"  # zset: instance id -> eviction time (ms)
        self.replicas = p + "replicas"  # zset: scheduler replica id -> heartbeat deadline (ms)
        self.queue = p + "queue"  # zset: "<arrival>:<id>" in policy order
        self.live = p + "live"  # set: ids of unfinished requests
        self.attached = p + "attached"  # zset: unfinished request id -> when a stream last held it (ms)
        self.arrival = p + "arrival"  # string: arrival counter
        self.incoming = p + "incoming"  # stream: doorbell for loops (submit, cancel, requeue)
        self.events = p + "events"  # stream: per step, new tokens and finishes
        self.counters = p + "counters"  # hash: namespace totals (preemptions, swaps, steps...)
        self.usage = p + "usage"  # hash: instance id -> JSON usage of its pool (placement's view)
        self.metrics_leader = p + "metrics-leader"  # string lease: the replica exporting namespace gauges
        self.loras = p + "loras"  # hash: LoRA adapter name -> JSON {path, digest, rank} (pagedserve/lora.py)

    def req(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def out(self, request_id: str) -> str:
        return f"{self.prefix}out:{request_id}"

    def logprobs(self, request_id: str) -> str:
        """List: one JSON entry per generated token (requests with sampling.logprobs)."""
        return f"{self.prefix}lp:{request_id}"

    def prompt_logprobs(self, request_id: str) -> str:
        """Hash: prompt position -> JSON entry (requests with sampling.prompt_logprobs)."""
        return f"{self.prefix}plp:{request_id}"

    def response(self, response_id: str) -> str:
        """String: a stored ``/v1/responses`` answer and its conversation (JSON), for ``previous_response_id``."""
        return f"{self.prefix}resp:{response_id}"

    def member(self, instance_id: str) -> str:
        return f"{self.prefix}exec:{instance_id}"

    def executor(self, instance_id: str) -> ExecutorKeys:
        return ExecutorKeys(f"{self.prefix}x:{instance_id}:")
