"""The store's Lua scripts on a real redis-server, checked against the pure codec and the schema
they must agree with: keys, queue entries, the events they emit, atomic claims, reaping, fencing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from scheduler_svc.core.blocks import DEVICE, BlockManager, Pool
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.request import Finish, Params, Request
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.state import codec, schema
from scheduler_svc.state.commit import CommitWriter
from scheduler_svc.state.store import Fenced, RedisStore, Stale


@pytest.fixture()
def store(redis_url: str, request: pytest.FixtureRequest) -> Iterator[RedisStore]:
    """A store on a namespace of its own."""
    loop = asyncio.new_event_loop()
    client = aioredis.from_url(redis_url, decode_responses=True)
    s = RedisStore(client, f"store-{request.node.name}")
    s.run = loop.run_until_complete  # type: ignore[attr-defined]
    yield s
    loop.run_until_complete(client.aclose())
    loop.close()


def submit(store: RedisStore, rid: str, priority: int = 0, policy: str = "fcfs") -> int:
    req = Request(rid, [5, 6, 7], Params(max_tokens=4), priority=priority)
    return store.run(store.submit(req, [], policy))  # type: ignore[attr-defined]


def test_queue_entries_follow_the_codec_and_the_policy(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    a = submit(store, "a", priority=5, policy="priority")
    b = submit(store, "b", priority=1, policy="priority")
    queue = run(store.r.zrange(store.keys.queue, 0, -1, withscores=True))
    assert queue == [
        (codec.queue_entry(b, "b", 1, "priority")[1], 1.0),
        (codec.queue_entry(a, "a", 5, "priority")[1], 5.0),
    ], "priority order, as the codec writes it"
    candidates, _ = run(store.look(8))
    assert [(c.request_id, c.prompt_len, c.max_tokens, c.priority) for c in candidates] == [
        ("b", 3, 4, 1),
        ("a", 3, 4, 5),
    ]


def test_cancelling_a_queued_request_emits_the_codecs_event(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    submit(store, "q")
    assert run(store.cancel("q", Finish.ABORT))
    assert not run(store.cancel("q", Finish.ABORT)), "it is no longer live"
    ((_, event),) = run(store.read_events("0-0", block_ms=0))
    assert event == schema.Event(finished={"q": ("abort", 0)})
    assert run(store.r.zcard(store.keys.queue)) == 0 and run(store.r.scard(store.keys.live)) == 0


def test_a_request_is_claimed_by_one_executor_only(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    arrival = submit(store, "r")
    key = codec.queue_entry(arrival, "r", 0, "fcfs")[1]
    ea, eb = run(store.acquire("ea", "x", 60_000)), run(store.acquire("eb", "y", 60_000))
    got_a = run(store.claim("ea", ea, 0, [key]))
    got_b = run(store.claim("eb", eb, 0, [key]))
    assert [c.req.request_id for c in got_a] == ["r"] and got_b == []
    assert run(store.r.smembers(store.keys.executor("ea").live)) == {"r"}
    assert run(store.r.hget(store.keys.req("r"), "executor")) == "ea"


def test_a_stale_epoch_can_neither_claim_nor_commit(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    arrival = submit(store, "r")
    old = run(store.acquire("e", "x", 60_000))
    run(store.r.delete(store.keys.executor("e").leader))
    new = run(store.acquire("e", "y", 60_000))
    assert new > old
    with pytest.raises(Fenced):
        run(store.claim("e", old, 0, [codec.queue_entry(arrival, "r", 0, "fcfs")[1]]))
    with pytest.raises(Fenced):
        run(store.apply("e", old, 0, [["SET", "x", "1"]]))
    assert run(store.r.zcard(store.keys.queue)) == 1


def test_writes_count_and_a_write_on_lost_state_is_refused(store: RedisStore) -> None:
    """As after a restart from an AOF that missed the last writes: the sequence went back."""
    run = store.run  # type: ignore[attr-defined]
    epoch = run(store.acquire("e", "x", 60_000))
    assert run(store.apply("e", epoch, 0, [])) == 1
    assert run(store.apply("e", epoch, 1, [])) == 2
    run(store.r.set(store.keys.executor("e").seq, 1))  # the second write was lost
    with pytest.raises(Stale):
        run(store.apply("e", epoch, 2, [["SET", "x", "1"]]))
    assert run(store.r.get("x")) is None
    assert run(store.load("e")).seq == 1


def test_reaping_requeues_at_the_same_place_finishes_cancelled_and_fences(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    keys = [codec.queue_entry(submit(store, rid), rid, 0, "fcfs")[1] for rid in ("r0", "r1")]
    epoch = run(store.acquire("e", "x", 60_000))
    run(store.claim("e", epoch, 0, keys))
    run(store.cancel("r1", Finish.STOP))  # placed: flagged for its loop
    assert run(store.reap("e")) == 1
    assert run(store.r.zrange(store.keys.queue, 0, -1)) == [keys[0]], "r0 is back where it was"
    assert run(store.r.hget(store.keys.req("r1"), "status")) == "finished"
    assert not any(run(store.r.exists(k)) for k in store.keys.executor("e").all())
    with pytest.raises(Fenced):
        run(store.apply("e", epoch, 1, [["SET", "x", "1"]]))
    assert run(store.acquire("e", "z", 60_000)) is None, "a reaped executor is never led again"


# -- one schema: the Lua and the Python write the same keys and the same events -------


def namespace_keys(store: RedisStore) -> set[str]:
    pattern = store.keys.prefix.replace("{", "\\{").replace("}", "\\}") + "*"

    async def scan() -> set[str]:
        return {key async for key in store.r.scan_iter(match=pattern)}

    return store.run(scan())  # type: ignore[attr-defined,no-any-return]


def named_keys(store: RedisStore, requests: list[str], executors: list[str]) -> set[str]:
    """Every key ``Keys`` and ``ExecutorKeys`` name for these requests and executors."""
    k = store.keys
    out = {key for name, key in vars(k).items() if name not in ("namespace", "prefix")}
    out |= {f(rid) for rid in requests for f in (k.req, k.out, k.logprobs, k.prompt_logprobs)}
    return out | {key for eid in executors for key in (k.member(eid), *k.executor(eid).all())}


def test_the_lua_builds_the_keys_and_queue_members_python_builds(store: RedisStore) -> None:
    k, x = store.keys, store.keys.executor("e:1")
    names = [name for name in vars(k) if name not in ("namespace", "prefix")]
    per_request = ["req", "out", "logprobs", "prompt_logprobs", "member"]
    per_executor = ["live", "computed", "pool", "counters", "leader", "epoch", "seq", "cache", "lru", "hashes"]
    items = [f"${{{n}}}" for n in names] + [f"${{{n}(ARGV[2])}}" for n in per_request]
    items += [f"${{x_{n}(ARGV[3])}}" for n in per_executor] + ["${queue_member(ARGV[4], ARGV[2])}"]
    script = schema.render("local p = ARGV[1]\nreturn {" + ", ".join(items) + ", ${queue_request_id(ARGV[5])}}")
    member = codec.queue_entry(42, "r:é", 0, "fcfs")[1]
    got = store.run(store.r.eval(script, 0, k.prefix, "r:é", "e:1", 42, member))  # type: ignore[attr-defined]
    assert got == [
        *(getattr(k, n) for n in names),
        *(getattr(k, n)("r:é") for n in per_request),
        *(getattr(x, n) for n in per_executor),
        member,
        "r:é",
    ]


def test_a_claim_a_commit_finishing_queued_and_reaping_touch_only_the_named_keys(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    members = [codec.queue_entry(submit(store, rid), rid, 0, "fcfs")[1] for rid in ("a", "b", "c")]
    epoch = run(store.acquire("e", "x", 60_000))
    claimed = run(store.claim("e", epoch, 0, members[:2]))
    sched = Scheduler(SchedulerConfig(max_model_len=64, watermark=0.0), BlockManager(4, *map(Pool.fresh, (8, 4, 0))))
    for c in claimed:
        sched.add(replace(c.req, params=replace(c.req.params, max_tokens=1 if c.req.request_id == "a" else 4)))
    out = sched.schedule()
    sched.update(out, {"a": 9, "b": 8})
    rec = sched.take_record()
    assert codec.event_of(rec) == schema.Event({"a": (0, [9]), "b": (0, [8])}, {"a": ("length", 1)})
    writer = CommitWriter(store.keys, "e", "fcfs")
    view = PoolView("e", True, 4, (8, 4, 0), (6, 4, 0), 1, 0, 64, 8)
    seq = run(
        store.apply("e", epoch, 1, writer.reset_ops((8, 4, 0), 4, 1) + writer.ops(rec, sched.blocks.is_free, view))
    )
    assert seq == 1 and run(store.load("e")).free[0] == [b for b in range(8) if sched.blocks.is_free(DEVICE, b)]
    assert namespace_keys(store) <= named_keys(store, ["a", "b", "c"], ["e"])
    assert run(store.cancel("c", Finish.ABORT))  # queued: finished by the script
    assert run(store.cancel("b", Finish.STOP))  # placed: finished when its executor is reaped
    assert run(store.reap("e")) == 0
    events = [event for _, event in run(store.read_events("0-0", block_ms=0))]
    assert events == [
        codec.event_of(rec),
        schema.Event(finished={"c": ("abort", 0)}),
        schema.Event(finished={"b": ("stop", 1)}),
    ]
    left = namespace_keys(store)
    assert left <= named_keys(store, ["a", "b", "c"], []), "nothing of the executor is left"
    assert not any(key.startswith(store.keys.executor("e").prefix) for key in left)
